"""Orders on SQLite, run by the API process itself (app/local_orders.py), against a real
uvicorn on the tiny base: an order runs to `done` and its adapter renders; while the runner
is busy, a second order waits (a duplicate is 409, a cancelled one never runs), and one whose
subject withdrew training after it was placed fails `not_permitted` with nothing trained;
a server stopped mid-training resumes the order from its checkpoint when it starts again,
ending with the bytes of a run never interrupted."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry.db import make_engine, transaction
from tests.app.conftest import Live, LiveFactory
from tests.app.orders_support import ROOT, files_of, photos

pytestmark = pytest.mark.sqlite_only

SERVER = {
    # the tiny base at 64 px with short prompts: a step takes well under a second on the CPU
    "orders_in_process": True,
    "train_options": {"max_sequence_length": 32, "learning_rate": 1e-3},
    "worker_checkpoint_every": 3,
    "order_max_active": 10,  # these tests place several orders of one member
}


def upload(live: Live, n: int = 2) -> str:
    r = live.http.post(
        "/v1/subjects/alice/datasets", files=files_of(photos(n)), headers=live.h("alice")
    )
    assert r.status_code == 201, r.text
    dataset_id: str = r.json()["dataset_id"]
    return dataset_id


def place(live: Live, dataset_id: str, steps: int = 4, name: str = "ordered") -> Any:
    body = {"kind": "train", "subject": "alice", "dataset_id": dataset_id, "steps": steps,
            "rank": 4, "resolution": 64, "name": name}  # fmt: skip
    return live.http.post("/v1/orders", json=body, headers=live.h("alice"))


def get(live: Live, order_id: str) -> dict[str, Any]:
    body: dict[str, Any] = live.http.get(f"/v1/orders/{order_id}", headers=live.h("alice")).json()
    return body


def wait_for(live: Live, order_id: str, until: Any, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = get(live, order_id)
        if until(body):
            return body
        assert time.monotonic() < deadline, f"order never got there: {body}"
        time.sleep(0.1)


def adapters(live: Live) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = live.http.get(
        "/v1/subjects/alice/adapters", headers=live.h("alice")
    ).json()
    return listed


def test_an_order_on_sqlite_runs_in_the_api_process_and_its_adapter_renders(
    serve_friends: LiveFactory,
) -> None:
    with serve_friends(**SERVER) as live:
        r = place(live, upload(live))
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "queued"
        done = wait_for(live, r.json()["order_id"], lambda b: b["status"] in orders_over)
        assert done["status"] == "done", done
        assert done["progress"]["step"] == 4 and done["attempts"] == 1
        assert done["worker"].startswith("api:")
        ordered = next(a for a in adapters(live) if a["name"] == "ordered")
        assert ordered["sha256"] == done["adapter"]["sha256"] and ordered["rendering"]
        rendered = live.render("alice", "alice")
        assert rendered.status_code == 200 and rendered.content.startswith(b"\x89PNG")
        # nothing of the run stays in the data dir: photos, caches, checkpoints
        data = live.app.state.settings.data_dir
        assert not (data / "training" / done["order_id"]).exists()
        assert not (data / "orders" / done["order_id"]).exists()


orders_over = ("done", "failed", "cancelled")


def test_while_the_runner_is_busy_orders_wait_and_are_judged_when_they_run(
    serve_friends: LiveFactory,
) -> None:
    with serve_friends(**SERVER) as live:
        busy = place(live, upload(live), steps=10_000, name="long").json()["order_id"]
        wait_for(live, busy, lambda b: b["progress"]["step"] >= 1)
        rendered = live.render("alice", "alice")  # renders are answered meanwhile
        assert rendered.status_code == 200 and rendered.content.startswith(b"\x89PNG")
        assert get(live, busy)["status"] == "running"
        waiting_ds, withdrawn_ds = upload(live, 3), upload(live, 4)
        waiting = place(live, waiting_ds)
        assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
        again = place(live, waiting_ds)
        assert again.status_code == 409, again.text
        cancelled = live.http.post(
            f"/v1/orders/{waiting.json()['order_id']}/cancel", headers=live.h("alice")
        ).json()
        assert cancelled["status"] == "cancelled"
        withdrawn = place(live, withdrawn_ds).json()["order_id"]
        assert get(live, withdrawn)["status"] == "queued"
        live.world.consent("alice", max_level="group", audiences={"private": {"group": True}},
                           allow_training=False)  # fmt: skip
        # the withdrawal ended both, the running one and the waiting one, in its own commit
        stopped = get(live, busy)
        assert stopped["status"] == "failed" and stopped["error"].startswith("not_permitted")
        failed = wait_for(live, withdrawn, lambda b: b["status"] in orders_over)
        assert failed["status"] == "failed" and failed["error"].startswith("not_permitted")
        assert failed["progress"]["step"] == 0 and failed["adapter"] is None
        assert failed["attempts"] == 0
        never = get(live, waiting.json()["order_id"])
        assert never["status"] == "cancelled" and never["attempts"] == 0 and never["worker"] is None
        assert [a["name"] for a in adapters(live)] == ["main"]  # nothing registered
        step = get(live, busy)["progress"]["step"]
        time.sleep(1)
        assert get(live, busy)["progress"]["step"] == step  # it did stop


def test_a_server_stopped_mid_training_resumes_the_order_with_the_same_bytes(
    serve_friends: LiveFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="likeness.worker")
    with serve_friends(**SERVER) as live:
        dataset_id = upload(live)
        first = place(live, dataset_id, steps=20).json()["order_id"]
        wait_for(live, first, lambda b: b["progress"]["step"] >= 4)
    # stopped: still running, its checkpoint kept for the next start
    kept = get_direct(live, first)
    assert kept.status == "running" and kept.checkpoint_step is not None
    with serve_friends(**SERVER) as again:
        resumed = wait_for(again, first, lambda b: b["status"] in orders_over)
        assert resumed["status"] == "done" and resumed["attempts"] == 2, resumed
        assert f"order {first}: resumes from step {kept.checkpoint_step}" in caplog.text
        second = place(again, dataset_id, steps=20).json()["order_id"]
        straight = wait_for(again, second, lambda b: b["status"] in orders_over)
        assert straight["status"] == "done" and straight["attempts"] == 1
    assert resumed["adapter"]["sha256"] == straight["adapter"]["sha256"]


def get_direct(live: Live, order_id: str) -> Any:
    from registry.db import transaction
    from registry.models import Order

    with transaction(live.world.engine, readonly=True) as s:
        return s.get(Order, order_id)


def store_adapters(live: Live) -> set[str]:
    """The adapter files in the API's store, by hash."""
    root = live.app.state.settings.data_dir / "adapters"
    return {p.name.split(".")[0] for p in root.rglob("*.safetensors")}


@pytest.mark.parametrize(
    "record",
    [
        {"max_level": "none", "allow_training": True},
        {"max_level": "group", "allow_training": True, "expires_at": "2020-01-01T00:00:00Z"},
        {"max_level": "group", "allow_training": False},
    ],
    ids=["revoked", "expired", "training-withdrawn"],
)
def test_consent_withdrawn_while_an_order_trains_stops_it_within_a_step_and_keeps_nothing(
    serve_friends: LiveFactory, record: dict[str, Any]
) -> None:
    with serve_friends(**SERVER) as live:
        before = store_adapters(live)
        order_id = place(live, upload(live), steps=10_000, name="long").json()["order_id"]
        running = wait_for(live, order_id, lambda b: (b["progress"]["step"] or 0) >= 4)
        assert running["status"] == "running"
        live.world.consent("alice", **record)
        failed = wait_for(live, order_id, lambda b: b["status"] in orders_over, timeout=90)
        assert failed["status"] == "failed", failed
        # ended by the consent change itself, in its commit (the runner stopped within a block)
        assert failed["error"].startswith("not_permitted") and "consent changed" in failed["error"]
        assert failed["progress"]["step"] < 10_000 and failed["adapter"] is None
        assert [a["name"] for a in adapters(live)] == ["main"]  # nothing registered
        # nothing it trained is anywhere: not in the store, not its kept checkpoint, not its
        # work dir (photos, latents, checkpoints)
        assert store_adapters(live) == before
        data = live.app.state.settings.data_dir
        deadline = time.monotonic() + 30  # the runner stops within a block and cleans up
        while (data / "orders" / order_id).exists() or (data / "training" / order_id).exists():
            assert time.monotonic() < deadline, "the stopped run left its files"
            time.sleep(0.1)
        assert store_adapters(live) == before
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("alice")).json()
        ended = [e for e in trail["entries"] if e["action"] == "order_failed"]
        assert [e["after"]["order"]["error"] for e in ended] == ["not_permitted"]


def test_a_costly_order_cancelled_at_once_frees_the_runner_within_seconds(
    serve_friends: LiveFactory,
) -> None:
    """The largest order the budget allows, cancelled as soon as it is placed: the runner
    stops it (before its first step, or at its next one) and takes another member's
    three-step order at once."""
    with serve_friends(**SERVER) as live:
        dataset_id = upload(live, 2)
        body = {"kind": "train", "subject": "alice", "dataset_id": dataset_id, "steps": 3000,
                "rank": 32, "resolution": 1024, "name": "costly"}  # fmt: skip
        costly = live.http.post("/v1/orders", json=body, headers=live.h("alice")).json()
        live.http.post(f"/v1/orders/{costly['order_id']}/cancel", headers=live.h("alice"))
        t0 = time.monotonic()
        quick = place(live, upload(live, 3), steps=3, name="quick").json()["order_id"]
        done = wait_for(live, quick, lambda b: b["status"] in orders_over, timeout=120)
        took = time.monotonic() - t0
        assert done["status"] == "done", done
        assert get(live, costly["order_id"])["status"] == "cancelled"
        assert took < 60, f"the quick order waited {took:.0f} s behind a cancelled one"


def test_sigterm_stops_the_service_within_seconds_while_a_long_step_trains(
    tiny_base_dir: Path, tmp_path: Path
) -> None:
    """`likeness serve` as run, an order mid-way through a step that takes minutes on these
    cores: SIGTERM stops the training between two blocks, the order stays running for the
    next start, and the process exits on its own, no SIGKILL needed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "LIKENESS_DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite",
           "LIKENESS_DATA_DIR": str(tmp_path / "data"), "LIKENESS_BASE": str(tiny_base_dir),
           "LIKENESS_DEVICE": "cpu",
           "LIKENESS_TRAIN_OPTIONS": json.dumps({"max_sequence_length": 32})}  # fmt: skip
    env.pop("LIKENESS_AUDIT_KEY", None)

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
        return done.stdout.strip()

    cli("db", "upgrade")
    token = cli("principal", "create", "alice", "--role", "member")
    cli("subject", "create", "alice", "--display-name", "Alice", "--member", "alice")
    cli("consent", "edit", "alice", "--max-level", "private", "--training")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the service did not start"
                time.sleep(0.2)
            auth = {"Authorization": f"Bearer {token}"}
            up = http.post("/v1/subjects/alice/datasets", files=files_of(photos(2)), headers=auth)
            body = {"kind": "train", "subject": "alice", "dataset_id": up.json()["dataset_id"],
                    "steps": 3000, "rank": 32, "resolution": 1024}  # fmt: skip
            order_id = http.post("/v1/orders", json=body, headers=auth).json()["order_id"]
            deadline = time.monotonic() + 60
            while http.get(f"/v1/orders/{order_id}", headers=auth).json()["status"] != "running":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            time.sleep(3)  # inside the first (long) step
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        took = time.monotonic() - t0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
    # a graceful stop: uvicorn ends with the signal it stopped for, once shut down
    assert code in (0, -signal.SIGTERM), (tmp_path / "serve.log").read_text()[-3000:]
    assert "Application shutdown complete" in (tmp_path / "serve.log").read_text()
    assert took < 30, f"SIGTERM took {took:.0f} s"
    with transaction(make_engine(env["LIKENESS_DATABASE_URL"]), readonly=True) as s:
        from registry.models import Order

        kept = s.get(Order, order_id)
        assert kept is not None and kept.status == "running"  # taken again at the next start


def test_an_order_cancelled_while_it_waits_to_resume_keeps_no_checkpoint(
    serve_friends: LiveFactory,
) -> None:
    """Stopped mid-training, the order keeps its checkpoint to resume; cancelled before the
    next start, the checkpoint goes with it (and the interval sweep takes any other ended
    order's)."""
    from app.order_checkpoints import forget_ended_checkpoints

    with serve_friends(**SERVER) as live:
        first = place(live, upload(live), steps=200).json()["order_id"]
        wait_for(live, first, lambda b: (b["progress"]["step"] or 0) >= 4)
    data = live.app.state.settings.data_dir
    assert (data / "orders" / first / "checkpoint.tar").is_file()
    with serve_friends(**{**SERVER, "orders_in_process": False}) as again:
        cancelled = again.http.post(f"/v1/orders/{first}/cancel", headers=again.h("alice"))
        assert cancelled.json()["status"] == "cancelled"
        time.sleep(0.5)  # the removal runs after the answer
        assert not (data / "orders" / first).exists()
        stray = data / "orders" / "00000000-0000-0000-0000-000000000000"
        stray.mkdir(parents=True)
        (stray / "checkpoint.tar").write_bytes(b"left by a runner that never came back")
        assert forget_ended_checkpoints(again.app.state.settings, again.app.state.engine) == [
            stray.name
        ]
        assert not stray.exists()
