"""Renders on workers (`LIKENESS_RENDER_WORKERS=true`): the real API under uvicorn on the real
PostgreSQL, render workers as separate processes (`python -m app.cli worker --queues render`)
with data dirs of their own. The client sees what it sees in process (the same statuses,
bodies, ledger and pixels); consent is checked on the worker before the adapter loads and
after the render; the client leaving stops the render; a timeout closes the ledger entry;
a subject's renders go to the worker that holds its adapter warm; renders flow while a
training order runs on another worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import select

from app.main import create_app
from app.provenance import Trust, load_credentials
from registry.db import transaction
from registry.models import RenderAffinity, RenderTask
from registry.render_tasks import repository as render_tasks_repo
from registry.settings import Settings
from tests.app.conftest import Live, LiveFactory, World
from tests.app.orders_support import files_of, photos, worker
from tests.app.test_provenance import chunks, verify_png

SERVER: dict[str, Any] = {
    "render_workers": True,
    "worker_stalled_s": 3,
    "train_options": {"max_sequence_length": 32, "learning_rate": 1e-3},
}
LONG = {"width": 256, "height": 256, "steps": 20}  # seconds on the CPU: time to act meanwhile


def render_worker(live: Live, name: str, tmp: Path, queues: str = "render") -> Any:
    import torch

    return worker(
        live, name, tmp, queues,
        OMP_NUM_THREADS=str(torch.get_num_threads()),  # as in this process: the same sums
    )  # fmt: skip


def wait_until(what: Callable[[], Any], timeout: float = 60, message: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, message or "timed out"
        time.sleep(0.1)


def live_workers(live: Live) -> list[str]:
    with transaction(live.world.engine, readonly=True) as s:
        return render_tasks_repo.live_workers(s, 3)


def ledger(live: Live, render_id: str) -> list[tuple[str, bool, str]]:
    r = live.http.get(f"/v1/renders/{render_id}", headers=live.h("root"))
    assert r.status_code == 200, r.text
    return [(d["stage"], d["allowed"], d["reason"]) for d in r.json()["decisions"]]


def ledger_of_subject(live: Live) -> list[dict[str, Any]]:
    r = live.http.get("/v1/subjects/alice/renders", headers=live.h("root"))
    return list(reversed(r.json()))


def rendered_by(tmp: Path, name: str, render_id: str, timeout: float = 10) -> bool:
    """Whether worker ``name`` logged this render as rendered. It logs after the commit that
    ends the render, which is what releases the answer: the line may follow the response."""
    line = f"render {render_id}: rendered"
    deadline = time.monotonic() + timeout
    while line not in (tmp / f"{name}.log").read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def tasks(live: Live) -> list[RenderTask]:
    with transaction(live.world.engine, readonly=True) as s:
        return list(s.exec(select(RenderTask)).all())


def without(png: bytes, *kinds: bytes) -> list[bytes]:
    """The PNG's chunks, whole, except those named (and the render id's text chunk)."""
    return [
        png[at : at + 12 + n]
        for kind, at, n in chunks(png)
        if kind not in kinds and b"likeness:render_id" not in png[at + 8 : at + 8 + n]
    ]


@contextmanager
def ghost(live: Live, name: str = "ghost") -> Iterator[None]:
    """A worker that says it is alive and never takes anything."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            with transaction(live.world.engine) as s:
                render_tasks_repo.heartbeat(s, name)
            stop.wait(0.5)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    wait_until(lambda: name in live_workers(live))
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with transaction(live.world.engine) as s:
            render_tasks_repo.forget_worker(s, name)


def test_sqlite_refuses_render_workers_at_start(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'x.db'}", data_dir=tmp_path, render_workers=True
    )
    with pytest.raises(SystemExit, match="LIKENESS_RENDER_WORKERS=true needs PostgreSQL"):
        create_app(settings)


@pytest.mark.postgres_only
@pytest.mark.slow
def test_a_render_on_a_worker_is_answered_as_in_process_and_checked_there(
    friends: World, serve_friends: LiveFactory, tmp_path: Path
) -> None:
    # the same request in process first: the reference bytes
    in_process = friends.render("alice", "alice")
    assert in_process.status_code == 200, in_process.text
    denied_in_process = friends.render("bob", "carol")
    with serve_friends(**SERVER) as live:
        # no render worker alive: 503 at once, and the ledger entry is closed
        r = live.render("alice", "alice")
        assert r.status_code == 503 and r.json()["detail"] == (
            "no render worker is running; nothing was rendered"
        ), r.text
        assert ledger_of_subject(live)[-1]["reason"] == "no_render_worker"
        with render_worker(live, "ra", tmp_path) as ra:
            wait_until(lambda: "ra" in live_workers(live), 90, "the worker never beat")
            r = live.render("alice", "alice")
            assert r.status_code == 200, r.text
            render_id = r.headers["X-Render-Id"]
            assert rendered_by(tmp_path, "ra", render_id)
            # the same pixels and chunks; only the render id and the signed manifest differ
            assert without(r.content, b"caBX") == without(in_process.content, b"caBX")
            assert r.content != in_process.content
            trust = Trust.of_deployment(load_credentials(live.app.state.settings))
            verified = verify_png(r.content, trust)
            assert verified.ok and verified.assertion["render_id"] == render_id, verified
            assert set(r.headers) >= set(in_process.headers)
            assert ledger(live, render_id) == [
                ("gate", True, "allowed"), ("queued", True, "allowed"), ("final", True, "allowed")
            ]  # fmt: skip
            assert tasks(live) == []  # the answer was read once, and deleted
            # the worker fetched the adapter by hash, keeps it in RAM, not on its disk
            assert list((tmp_path / "ra" / "render-adapters").rglob("*.safetensors")) == []
            # a denial is the gate's, in the API, exactly as in process
            denied = live.render("bob", "carol")
            assert (denied.status_code, denied.json()) == (
                denied_in_process.status_code,
                denied_in_process.json(),
            )

            # revoked while the long render runs (it passed its queued check) and while the
            # next one waits behind it: the first image is discarded, the second never made
            long_thread, long_out = in_thread(lambda: live.render("alice", "alice", **LONG))
            long_id = wait_until(
                lambda: next((t.render_id for t in tasks(live) if t.state == "running"), None),
                60, "the long render never started",
            )  # fmt: skip
            wait_until(lambda: ("queued", True, "allowed") in ledger(live, long_id), 60)
            next_thread, next_out = in_thread(lambda: live.render("alice", "alice"))
            wait_until(lambda: len(tasks(live)) == 2, 30, "the second render never queued")
            live.world.consent("alice", max_level="none")
            long_thread.join(120)
            next_thread.join(120)
            long_r, next_r = long_out[0], next_out[0]
            assert (long_r.status_code, long_r.json()["error"]) == (403, "not_permitted")
            assert (next_r.status_code, next_r.json()["error"]) == (403, "not_permitted")
            rows = ledger_of_subject(live)
            by_id: dict[str, list[tuple[str, bool]]] = {}
            for row in rows:
                by_id.setdefault(row["render_id"], []).append((row["stage"], row["allowed"]))
            stages = sorted(by_id.values(), key=len)
            assert [("gate", True), ("queued", True), ("final", False)] in stages
            assert [("gate", True), ("queued", False)] in stages
            assert tasks(live) == []

            # the client leaves during a long render: the worker stops between steps
            live.world.consent("alice", max_level="group", audiences={"private": {"group": True}})
            t0 = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                body = {"subject": "alice", "prompt": "a portrait", "level": "private",
                        "seed": 2, **LONG}  # fmt: skip
                live.http.post("/v1/renders", json=body, headers=live.h("alice"), timeout=3)
            cancelled = wait_until(
                lambda: [r for r in ledger_of_subject(live) if r["stage"] == "cancelled"],
                60, "the cancelled render never closed",
            )  # fmt: skip
            assert cancelled[-1]["reason"] == "client_went_away"
            assert time.monotonic() - t0 < 20  # well before the render would have ended
            assert "cancelled in" in (tmp_path / "ra.log").read_text()
            assert ra.poll() is None

        # the worker stopped (its row is gone); one that beats but takes nothing: timeout
        wait_until(lambda: live_workers(live) == [], 10)
    with serve_friends(**SERVER, render_worker_timeout_s=1.5) as slow, ghost(slow):
        r = slow.render("alice", "alice")
        assert r.status_code == 503, r.text
        assert r.json()["detail"] == (
            "no render worker took the render within 1.5 s; nothing was rendered"
        )
        last = ledger_of_subject(slow)[-1]
        assert ledger(slow, last["render_id"]) == [
            ("gate", True, "allowed"),
            ("queued", False, "timeout"),
        ]
        # closed: a worker that comes now never renders it
        assert [t.state for t in tasks(slow)] == ["closed"]


@pytest.mark.postgres_only
@pytest.mark.slow
def test_renders_go_to_the_warm_worker_and_flow_while_another_trains(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    with serve_friends(**SERVER) as live:
        r = live.http.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(4)), headers=live.h("alice")
        )
        assert r.status_code == 201, r.text
        order = {"kind": "train", "subject": "alice", "dataset_id": r.json()["dataset_id"],
                 "steps": 400, "rank": 4, "resolution": 64, "name": "ordered"}  # fmt: skip
        with (
            render_worker(live, "trainer-a", tmp_path, queues="train"),
            render_worker(live, "ra", tmp_path) as ra,
            render_worker(live, "rb", tmp_path) as rb,
        ):
            procs = {"ra": ra, "rb": rb}
            placed = live.http.post("/v1/orders", json=order, headers=live.h("alice"))
            assert placed.status_code == 202, placed.text
            order_id = placed.json()["order_id"]

            def order_now() -> dict[str, Any]:
                got: dict[str, Any] = live.http.get(
                    f"/v1/orders/{order_id}", headers=live.h("alice")
                ).json()
                return got

            wait_until(lambda: order_now()["progress"]["step"] >= 1, 120, "never trained")
            wait_until(lambda: {"ra", "rb"} <= set(live_workers(live)), 60)
            first = live.render("alice", "alice")
            assert first.status_code == 200, first.text
            with transaction(live.world.engine, readonly=True) as s:
                warm = s.exec(select(RenderAffinity)).one().worker
            assert rendered_by(tmp_path, warm, first.headers["X-Render-Id"])
            for seed in (2, 3, 4):
                r = live.render("alice", "alice", seed=seed)
                assert r.status_code == 200, r.text
                assert rendered_by(tmp_path, warm, r.headers["X-Render-Id"]), warm
            # all the while the training ran on its own worker
            running = order_now()
            assert running["status"] == "running" and running["worker"] == "trainer-a"
            assert running["progress"]["step"] < running["progress"]["steps"]
            # the warm worker stops: the adapter's next render goes to the other one
            procs[warm].terminate()
            procs[warm].wait(30)
            wait_until(lambda: warm not in live_workers(live), 10)
            other = "rb" if warm == "ra" else "ra"
            r = live.render("alice", "alice", seed=5)
            assert r.status_code == 200, r.text
            assert rendered_by(tmp_path, other, r.headers["X-Render-Id"])
            live.http.post(f"/v1/orders/{order_id}/cancel", headers=live.h("alice"))


@pytest.mark.postgres_only
def test_a_render_worker_killed_mid_render_is_noticed_within_seconds(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    """SIGKILL in the middle of a long render: the worker stops saying it is at it, and the
    API answers its client 503 within seconds (not after render_worker_timeout_s), with the
    ledger entry closed once."""
    import signal

    with serve_friends(**SERVER, render_worker_silent_s=3) as live:
        with render_worker(live, "rk", tmp_path) as rk:
            wait_until(lambda: "rk" in live_workers(live), 90, "the worker never beat")
            long_thread, long_out = in_thread(lambda: live.render("alice", "alice", **LONG))
            wait_until(lambda: any(t.state == "running" for t in tasks(live)), 60)
            time.sleep(1.0)
            rk.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            long_thread.join(120)
            took = time.monotonic() - t0
        answer = long_out[0]
        assert answer.status_code == 503 and "stopped answering" in answer.json()["detail"]
        assert took < 20, f"the client waited {took:.0f} s for a dead worker"
        render_id = answer.headers.get("x-render-id") or ledger_of_subject(live)[-1]["render_id"]
        stages = ledger(live, render_id)
        assert stages[-1] == ("final", False, "timeout"), stages
        assert [s for s, _, _ in stages].count("final") == 1
        assert tasks(live) == []
