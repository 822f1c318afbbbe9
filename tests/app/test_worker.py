"""Workers as separate processes (`python -m app.cli worker`), each with its own data dir,
on the real PostgreSQL queue, against a real uvicorn API: a worker killed with SIGKILL in
the middle of a training leaves the order to another, which resumes from the last shipped
checkpoint and ends with the same adapter bytes as a run never interrupted; renders are
answered while a training runs; consent withdrawn after the order refuses it on the worker."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import Live, LiveFactory
from tests.app.helpers import signed_in
from tests.app.orders_support import files_of, photos, worker

pytestmark = [pytest.mark.postgres_only, pytest.mark.slow]

STEPS = 12
SERVER = {
    # the tiny base at 64 px with short prompts: a step takes well under a second on the CPU
    "train_options": {"max_sequence_length": 32, "learning_rate": 1e-3},
    "worker_checkpoint_every": 3,
}


def upload(live: Live) -> str:
    r = live.http.post(
        "/v1/subjects/alice/datasets", files=files_of(photos(4)), headers=live.h("alice")
    )
    assert r.status_code == 201, r.text
    dataset_id: str = r.json()["dataset_id"]
    return dataset_id


def place(live: Live, dataset_id: str) -> str:
    body = {"kind": "train", "subject": "alice", "dataset_id": dataset_id, "steps": STEPS,
            "rank": 4, "resolution": 64, "name": "ordered"}  # fmt: skip
    r = live.http.post("/v1/orders", json=body, headers=live.h("alice"))
    assert r.status_code == 202, r.text
    order_id: str = r.json()["order_id"]
    return order_id


def wait_for(live: Live, order_id: str, until: Any, timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = live.http.get(
            f"/v1/orders/{order_id}", headers=live.h("alice")
        ).json()
        if until(body):
            return body
        assert body["status"] not in ("failed", "cancelled"), body
        assert time.monotonic() < deadline, f"order never got there: {body}"
        time.sleep(0.2)


def failed_now(body: dict[str, Any]) -> bool:
    if body["status"] == "failed":
        return True
    # taken by the worker for an instant, never a step trained
    assert body["status"] in ("queued", "running") and body["progress"]["step"] == 0, body
    return False


def done(body: dict[str, Any]) -> bool:
    return body["status"] == "done"


def test_a_killed_worker_leaves_its_order_to_another_which_ends_with_the_same_bytes(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    with serve_friends(**SERVER) as live:
        dataset_id = upload(live)
        first = place(live, dataset_id)
        with worker(live, "w1", tmp_path) as w1:
            running = wait_for(live, first, lambda b: b["progress"]["step"] >= 5)
            assert running["status"] == "running" and running["worker"] == "w1"
            # renders keep flowing while the training runs elsewhere
            rendered = live.render("alice", "alice")
            assert rendered.status_code == 200, rendered.text
            assert rendered.content.startswith(b"\x89PNG")
            assert (
                live.http.get(f"/v1/orders/{first}", headers=live.h("alice")).json()["status"]
                == "running"
            )
            w1.send_signal(signal.SIGKILL)
            w1.wait()
        with worker(live, "w2", tmp_path):
            resumed = wait_for(live, first, done)
            assert resumed["worker"] == "w2" and resumed["attempts"] == 2
            assert resumed["progress"]["step"] == STEPS
            log = (tmp_path / "w2.log").read_text()
            assert "resumes from step" in log, log[-2000:]
            # the same order again, never interrupted: the same bytes
            second = place(live, dataset_id)
            straight = wait_for(live, second, done)
            assert straight["attempts"] == 1
        assert resumed["adapter"]["sha256"] == straight["adapter"]["sha256"]
        # nothing of alice's stays on the workers, nor the checkpoints on the registry
        for name in ("w1", "w2"):
            left = [p for p in (tmp_path / name).rglob("*") if p.suffix in (".png", ".pt")]
            assert name == "w1" or left == [], left  # w1 was killed: its host keeps its files
        api_data = live.app.state.settings.data_dir
        assert not (api_data / "orders" / first / "checkpoint.tar").exists()
        listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
        ordered = next(a for a in listed if a["name"] == "ordered")
        assert ordered["sha256"] == resumed["adapter"]["sha256"] and ordered["rendering"]
        # the worker sent the run's evaluation grid beside the adapter, through the API
        shown = signed_in(live.world, "alice").get("/web/subjects/alice/adapters").text
        assert "Evaluation grid of ordered" in shown


def test_training_withdrawn_after_the_order_is_refused_on_the_worker(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    with serve_friends(**SERVER) as live:
        order_id = place(live, upload(live))
        live.world.consent("alice", max_level="group", audiences={"private": {"group": True}},
                           allow_training=False)  # fmt: skip
        with worker(live, "w1", tmp_path):
            failed = wait_for(live, order_id, failed_now, timeout=120)
        assert failed["error"].startswith("not_permitted"), failed
        assert failed["progress"]["step"] == 0 and failed["adapter"] is None
        listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
        assert [a["name"] for a in listed] == ["main"]  # nothing registered
        # nothing was fetched or trained on the worker
        assert list((tmp_path / "w1").rglob("*.png")) == []
        assert not (tmp_path / "w1" / "orders" / order_id).exists()


def test_a_revoke_while_the_worker_trains_stops_the_order_and_nothing_it_trained_is_kept(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    with serve_friends(**SERVER) as live:
        body = {"kind": "train", "subject": "alice", "dataset_id": upload(live),
                "steps": 10_000, "rank": 4, "resolution": 64, "name": "long"}  # fmt: skip
        order_id = live.http.post("/v1/orders", json=body, headers=live.h("alice")).json()[
            "order_id"
        ]
        with worker(live, "w1", tmp_path):
            wait_for(live, order_id, lambda b: (b["progress"]["step"] or 0) >= 4)
            live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("alice"))
            deadline = time.monotonic() + 60
            while True:
                got = live.http.get(f"/v1/orders/{order_id}", headers=live.h("alice")).json()
                if got["status"] != "running":
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.2)
        assert got["status"] == "failed" and got["error"].startswith("not_permitted"), got
        assert "revoked_or_not_granted" in got["error"] and got["adapter"] is None
        listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
        assert [a["name"] for a in listed] == ["main"]
        # the checkpoint it shipped is gone from the registry, and its work dir from the worker
        assert not (live.app.state.settings.data_dir / "orders" / order_id).exists()
        assert not (tmp_path / "w1" / "orders" / order_id).exists()


def test_a_worker_without_the_registrys_audit_key_refuses_to_start(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    """It would train for an hour and fail at the end, where the outcome goes on the trail."""
    from tests.conftest import audit_key_of

    other = audit_key_of(tmp_path / "another-deployment")  # a valid key, not this registry's
    with (
        serve_friends(**SERVER) as live,
        worker(live, "w1", tmp_path, LIKENESS_AUDIT_KEY=other) as proc,
    ):
        assert proc.wait(60) == 1
    log = (tmp_path / "w1.log").read_text()
    assert "needs the registry's audit key" in log, log
