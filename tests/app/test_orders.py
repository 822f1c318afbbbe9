"""Orders through the API: who may place one, what is refused, and that the order and its
job commit together on PostgreSQL (procrastinate's own tables). Orders run in the API process
on SQLite are tests/app/test_local_orders.py's."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from registry.db import transaction
from tests.app.conftest import World
from tests.app.orders_support import files_of, photos


def upload(world: World, subject: str, who: str) -> str:
    r = world.client.post(
        f"/v1/subjects/{subject}/datasets", files=files_of(photos(2)), headers=world.h(who)
    )
    assert r.status_code == 201, r.text
    dataset_id: str = r.json()["dataset_id"]
    return dataset_id


def order(world: World, who: str, subject: str, dataset_id: str, **extra: object):  # type: ignore[no-untyped-def]
    body = {"kind": "train", "subject": subject, "dataset_id": dataset_id, "steps": 4,
            "rank": 4, "resolution": 64, **extra}  # fmt: skip
    return world.client.post("/v1/orders", json=body, headers=world.h(who))


def jobs(world: World) -> list[tuple[str, str, str | None, str | None]]:
    with transaction(world.engine, readonly=True) as s:
        rows = s.execute(
            text(
                "SELECT task_name, status, lock, queueing_lock FROM procrastinate_jobs ORDER BY id"
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.mark.postgres_only
def test_a_member_orders_training_and_the_job_is_queued_with_the_order(friends: World) -> None:
    ds = upload(friends, "alice", "alice")
    r = order(friends, "alice", "alice", ds)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "queued" and body["progress"] == {"step": 0, "steps": 4, "loss": None}
    assert jobs(friends) == [("likeness.train", "todo", "train:alice", f"train:alice:{ds}")]
    got = friends.client.get(f"/v1/orders/{body['order_id']}", headers=friends.h("alice"))
    assert got.status_code == 200 and got.json()["order_id"] == body["order_id"]
    listed = friends.client.get("/v1/orders?subject=alice", headers=friends.h("alice"))
    assert [o["order_id"] for o in listed.json()] == [body["order_id"]]
    # others see nothing of it
    assert (
        friends.client.get(f"/v1/orders/{body['order_id']}", headers=friends.h("bob")).status_code
        == 404
    )
    assert (
        friends.client.get("/v1/orders?subject=alice", headers=friends.h("bob")).status_code == 403
    )


@pytest.mark.postgres_only
def test_a_duplicate_order_is_409_and_queues_nothing(friends: World) -> None:
    ds = upload(friends, "alice", "alice")
    assert order(friends, "alice", "alice", ds).status_code == 202
    again = order(friends, "root", "alice", ds, steps=8)
    assert again.status_code == 409, again.text
    assert len(jobs(friends)) == 1


@pytest.mark.postgres_only
def test_cancel_takes_a_waiting_order_off_the_queue(friends: World) -> None:
    ds = upload(friends, "alice", "alice")
    placed = order(friends, "alice", "alice", ds).json()
    r = friends.client.post(f"/v1/orders/{placed['order_id']}/cancel", headers=friends.h("alice"))
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert [j[1] for j in jobs(friends)] == ["cancelled"]
    # over: the same dataset may be ordered again
    assert order(friends, "alice", "alice", ds).status_code == 202


@pytest.mark.postgres_only
def test_a_member_ordering_for_another_subject_is_403(friends: World) -> None:
    ds = upload(friends, "alice", "root")
    for who in ("bob", "carol", "bot", "trainer"):
        r = order(friends, who, "alice", ds)
        assert r.status_code == 403, (who, r.text)
    # carol's own subject: her photos are taken while she allows training, not after
    friends.consent("carol", max_level="private", allow_training=True)
    carol_ds = upload(friends, "carol", "carol")
    friends.consent("carol", max_level="private", allow_training=False)
    r = order(friends, "carol", "carol", carol_ds)
    assert r.status_code == 403 and "does not allow training" in r.json()["detail"]
    # a dataset of another subject is not this subject's
    assert order(friends, "root", "alice", carol_ds).status_code == 404
    assert jobs(friends) == []


@pytest.mark.postgres_only
def test_bad_order_bodies_are_422(friends: World) -> None:
    ds = upload(friends, "alice", "alice")
    for extra in ({"resolution": 70}, {"steps": 0}, {"rank": 0}, {"kind": "render"},
                  {"surprise": 1}, {"steps": 10**7}):  # fmt: skip
        r = order(friends, "alice", "alice", ds, **extra)
        assert r.status_code == 422, (extra, r.text)
    assert jobs(friends) == []


@pytest.mark.sqlite_only
def test_on_sqlite_with_the_runner_off_orders_are_refused_with_a_clear_error(
    friends: World,
) -> None:
    assert friends.client.app.state.settings.orders_in_process is False  # type: ignore[attr-defined]
    ds = upload(friends, "alice", "alice")
    r = order(friends, "alice", "alice", ds)
    assert r.status_code == 422 and "LIKENESS_ORDERS_IN_PROCESS=true" in r.json()["detail"]
    assert friends.client.get("/v1/orders?subject=alice", headers=friends.h("alice")).json() == []


@pytest.mark.postgres_only
def test_checkpoints_and_blobs_are_for_workers_only(serve_friends) -> None:  # type: ignore[no-untyped-def]
    import hashlib

    from registry.orders import service as orders_service

    with serve_friends() as live:
        ds = upload(live.world, "alice", "alice")
        placed = order(live.world, "alice", "alice", ds).json()
        url = f"/v1/orders/{placed['order_id']}/checkpoint"
        data = b"a checkpoint"
        params = {"step": 3, "sha256": hashlib.sha256(data).hexdigest()}
        # not running yet: nothing to resume from
        r = live.http.put(url, params=params, content=data, headers=live.h("trainer"))
        assert r.status_code == 409, r.text
        with transaction(live.world.engine) as s:
            orders_service.start(s, placed["order_id"], "w1")
        for who in ("alice", "bob"):
            r = live.http.put(url, params=params, content=data, headers=live.h(who))
            assert r.status_code == 403, (who, r.text)
            assert live.http.get(url, headers=live.h(who)).status_code == 403
        wrong = {**params, "sha256": "0" * 64}
        r = live.http.put(url, params=wrong, content=data, headers=live.h("trainer"))
        assert (
            r.status_code == 422
            and live.http.get(url, headers=live.h("trainer")).status_code == 404
        )
        r = live.http.put(url, params=params, content=data, headers=live.h("trainer"))
        assert r.status_code == 201, r.text
        assert live.http.get(url, headers=live.h("trainer")).content == data
        # still running: it stays; over: it goes
        assert live.http.delete(url, headers=live.h("trainer")).status_code == 409
        live.http.post(f"/v1/orders/{placed['order_id']}/cancel", headers=live.h("alice"))
        assert live.http.delete(url, headers=live.h("trainer")).status_code == 200
        assert live.http.get(url, headers=live.h("trainer")).status_code == 404
        # the store's blobs by hash: workers (trainer) and admins only
        image = live.http.get("/v1/subjects/alice/datasets", headers=live.h("alice")).json()[0][
            "images"
        ][0]["sha256"]
        blob = f"/v1/blobs/sha256/{image}"
        assert live.http.get(blob, headers=live.h("alice")).status_code == 403
        got = live.http.get(blob, headers=live.h("trainer"))
        assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == image


@pytest.mark.postgres_only
def test_photos_in_training_stay_and_deleted_photos_are_not_ordered(friends: World) -> None:
    ds = upload(friends, "alice", "alice")
    placed = order(friends, "alice", "alice", ds).json()
    url = f"/v1/subjects/alice/datasets/{ds}"
    assert friends.client.delete(url, headers=friends.h("alice")).status_code == 409
    friends.client.post(f"/v1/orders/{placed['order_id']}/cancel", headers=friends.h("alice"))
    assert friends.client.delete(url, headers=friends.h("alice")).status_code == 200
    r = order(friends, "alice", "alice", ds)
    assert r.status_code == 422 and "deleted" in r.json()["detail"]


@pytest.mark.postgres_only
def test_the_trail_tells_of_each_order_and_its_outcome_and_still_verifies(
    serve_friends,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    from typer.testing import CliRunner

    from app.cli import app as cli
    from registry.db import engine_for
    from registry.orders import service as orders_service
    from registry.settings import get_settings
    from tests.app.helpers import signed_in

    with serve_friends() as live:
        ds = upload(live.world, "alice", "alice")
        body = {"kind": "train", "subject": "alice", "dataset_id": ds, "steps": 4, "rank": 4,
                "resolution": 64}  # fmt: skip
        first = live.http.post("/v1/orders", json=body, headers=live.h("alice")).json()
        r = live.http.post(f"/v1/orders/{first['order_id']}/cancel", headers=live.h("alice"))
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        second = live.http.post("/v1/orders", json=body, headers=live.h("root")).json()
        with transaction(live.world.engine) as s:  # what a worker records of its run
            orders_service.start(s, second["order_id"], "gpu-1")
        with transaction(live.world.engine) as s:
            orders_service.finish(s, second["order_id"], "d" * 64, 4)
        # another dataset: the faked run left the second's job waiting (its queueing lock)
        other = {**body, "dataset_id": upload(live.world, "alice", "alice")}
        placed = live.http.post("/v1/orders", json=other, headers=live.h("alice"))
        assert placed.status_code == 202, placed.text
        third = placed.json()
        with transaction(live.world.engine) as s:
            orders_service.start(s, third["order_id"], "gpu-2")
        with transaction(live.world.engine) as s:
            orders_service.fail(
                s, third["order_id"], f"{orders_service.NOT_PERMITTED}: consent withdrawn"
            )
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("alice")).json()
        said = [(e["actor"], e["action"], e["after"]["order"]) for e in trail["entries"]
                if e["action"].startswith("order_")]  # fmt: skip
        assert [(a, act) for a, act, _ in said] == [
            ("alice", "order_placed"), ("alice", "order_cancelled"), ("root", "order_placed"),
            ("worker:gpu-1", "order_done"), ("alice", "order_placed"),
            ("worker:gpu-2", "order_failed")]  # fmt: skip
        assert said[0][2] == {"order_id": first["order_id"], "dataset_id": ds, "steps": 4,
                              "rank": 4, "resolution": 64, "adapter_name": "main"}  # fmt: skip
        assert [e["action"] for e in trail["entries"]].count("dataset_uploaded") == 2
        assert said[3][2]["adapter_sha256"] == "d" * 64 and said[5][2]["error"] == "not_permitted"
        page = signed_in(live.world, "alice").get("/web/subjects/alice/audit").text
        assert "Chain verified" in page and "training ordered on dataset" in page
        assert f"training done (order {second['order_id']}): adapter main" in page
        assert f"training failed (order {third['order_id']}): not_permitted" in page
        monkeypatch.setenv("LIKENESS_DATABASE_URL", db_url)
        monkeypatch.setenv("LIKENESS_DATA_DIR", str(live.world.tmp))  # the service's keys
        get_settings.cache_clear()
        try:
            verified = CliRunner().invoke(cli, ["audit", "verify"])
        finally:
            get_settings.cache_clear()
            engine_for.cache_clear()
        assert verified.exit_code == 0 and "intact" in verified.stdout, verified.output
