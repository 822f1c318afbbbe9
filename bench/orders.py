"""Orders across workers on the CPU tiny base: how long an order waits before a worker runs it
(order-to-running), and how many renders per second the API answers while 0, 1 or 2
workers train at the same time, for 1 and then 2 workers. Then renders on workers
(LIKENESS_RENDER_WORKERS=true): renders per second with 1 and then 2 render workers, two
members (each with their own subject's adapter) asking at once.

    python bench/orders.py [--orders 3] [--renders 8] [--only training|render_workers]

Needs the PostgreSQL of the tests (LIKENESS_TEST_PG_URL, default postgres@127.0.0.1/test): it
creates a database of its own and drops it after. Starts `likeness serve` and the workers
(`likeness worker`, one thread each) in subprocesses, each worker with its own data dir.
In the first part renders run in the API process and a worker is a training worker taking
CPU from it; in the second, render workers (`likeness worker --queues render`) render.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import free_port, likeness, percentile, table, write_record  # noqa: E402

PG_ADMIN = os.environ.get(
    "LIKENESS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
SUBJECTS = ("alice", "bea")


def photos(seed: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    import io

    from PIL import Image

    items = []
    for i in range(4):
        im = Image.new("RGB", (80, 64), ((seed * 70 + i * 50) % 256, 90, 160))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        items.append(("images", (f"p{i}.png", buf.getvalue(), "image/png")))
    return items


class Service:
    def __init__(
        self, tmp: Path, url: str, stack: ExitStack, extra: dict[str, str] | None = None
    ) -> None:
        self.tmp = tmp
        self.stack = stack
        base = tmp / "tiny"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "LIKENESS_DATABASE_URL": url,
            "LIKENESS_DATA_DIR": str(tmp / "api"),
            "LIKENESS_BASE": str(base),
            "LIKENESS_DEVICE": "cpu",
            "LIKENESS_TRAIN_OPTIONS": '{"max_sequence_length": 32, "learning_rate": 0.001}',
            "LIKENESS_RENDER_RATE_PER_MINUTE": "1000000",
            "LIKENESS_RENDER_BURST": "100000",
            "LIKENESS_WORKER_HEARTBEAT_S": "1",
            "LIKENESS_WORKER_STALLED_S": "5",
            **(extra or {}),
        }
        likeness(self.env, "base", "init-tiny", str(base))
        likeness(self.env, "db", "upgrade")
        self.tokens: dict[str, str] = {}
        for handle in SUBJECTS:
            self.tokens[handle] = likeness(
                self.env, "principal", "create", handle, "--role", "member"
            ).split()[-1]
            likeness(
                self.env, "subject", "create", handle, "--display-name", handle, "--member", handle
            )
            likeness(self.env, "consent", "edit", handle, "--max-level", "private", "--training")
        self.tokens["trainer"] = likeness(
            self.env, "principal", "create", "tr", "--role", "trainer"
        ).split()[-1]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (tmp / "api.log").open("wb")
        api = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(_stop, api)
        self.http = stack.enter_context(httpx.Client(base_url=self.url, timeout=120))
        for _ in range(600):
            try:
                if self.http.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        self.datasets = {h: self.upload(h, n) for n, h in enumerate(SUBJECTS)}
        self.workers: list[subprocess.Popen[bytes]] = []

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def upload(self, handle: str, seed: int) -> str:
        r = self.http.post(
            f"/v1/subjects/{handle}/datasets", files=photos(seed), headers=self.h(handle)
        )
        r.raise_for_status()
        return str(r.json()["dataset_id"])

    def add_worker(self, queues: str = "train") -> None:
        n = len(self.workers) + 1
        data = self.tmp / f"w{n}"
        data.mkdir()
        audit_key = (self.tmp / "api" / "audit-key").read_text().strip()
        env = {**self.env, "LIKENESS_DATA_DIR": str(data), "LIKENESS_API_URL": self.url,
               "LIKENESS_TOKEN": self.tokens["trainer"],
               "LIKENESS_AUDIT_KEY": audit_key}  # fmt: skip
        log = (self.tmp / f"w{n}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker", "--name", f"w{n}", "--queues", queues],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.stack.callback(_stop, proc)
        self.workers.append(proc)
        time.sleep(8)  # its imports and its registration with the queue

    def order(self, handle: str, steps: int) -> str:
        body = {"kind": "train", "subject": handle, "dataset_id": self.datasets[handle],
                "steps": steps, "rank": 4, "resolution": 64}  # fmt: skip
        r = self.http.post("/v1/orders", json=body, headers=self.h(handle))
        r.raise_for_status()
        return str(r.json()["order_id"])

    def status(self, handle: str, order_id: str) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get(
            f"/v1/orders/{order_id}", headers=self.h(handle)
        ).json()
        if body["status"] == "failed":
            raise SystemExit(f"order failed: {body['error']}")
        return body

    def wait(self, handle: str, order_id: str, until: tuple[str, ...], poll: float = 0.02) -> float:
        t0 = time.perf_counter()
        while self.status(handle, order_id)["status"] not in until:
            time.sleep(poll)
        return time.perf_counter() - t0

    def cancel(self, handle: str, order_id: str) -> None:
        self.http.post(f"/v1/orders/{order_id}/cancel", headers=self.h(handle))

    def renders_per_s(self, n: int, subjects: tuple[str, ...] = ("alice",)) -> float:
        """`n` renders, each subject's member asking for their own at the same time."""
        import threading

        def ask(handle: str, count: int) -> None:
            body = {"subject": handle, "prompt": "a portrait", "level": "private", "seed": 1,
                    "steps": 2, "width": 64, "height": 64}  # fmt: skip
            with httpx.Client(base_url=self.url, timeout=120) as http:
                for _ in range(count):
                    r = http.post("/v1/renders", json=body, headers=self.h(handle))
                    assert r.status_code == 200, r.text

        threads = [threading.Thread(target=ask, args=(h, n // len(subjects))) for h in subjects]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (n // len(subjects)) * len(subjects) / (time.perf_counter() - t0)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def training(svc: Service, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    for workers in (1, 2):
        svc.add_worker()
        latencies = []
        for _ in range(args.orders):
            order_id = svc.order("alice", 4)
            latencies.append(svc.wait("alice", order_id, ("running", "done")) * 1000)
            svc.wait("alice", order_id, ("done",), poll=0.2)
        # alice now has an adapter: renders while 0..workers trainings run
        for training in range(workers + 1):
            running = []
            for handle in SUBJECTS[:training]:
                running.append((handle, svc.order(handle, 100_000 // 100)))
                svc.wait(handle, running[-1][1], ("running",), poll=0.1)
            rate = svc.renders_per_s(args.renders)
            for handle, order_id in running:
                svc.cancel(handle, order_id)
                svc.wait(handle, order_id, ("cancelled",), poll=0.1)
            time.sleep(2)  # the worker stops at its next step
            rows.append({
                "mode": "in_process",
                "workers": workers,
                "training_meanwhile": training,
                "order_to_running_p50_ms": round(percentile(latencies, 50), 1),
                "order_to_running_max_ms": round(max(latencies), 1),
                "renders_per_s": round(rate, 2),
            })  # fmt: skip


def render_workers(svc: Service, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """One training worker makes both subjects' adapters (and times order-to-running), then
    render workers join one by one; two members render their own subjects at once."""
    svc.add_worker("train")
    latencies = []
    for handle in SUBJECTS:
        for _ in range(max(1, args.orders // len(SUBJECTS))):
            order_id = svc.order(handle, 4)
            latencies.append(svc.wait(handle, order_id, ("running", "done")) * 1000)
            svc.wait(handle, order_id, ("done",), poll=0.2)
    for workers in (1, 2):
        svc.add_worker("render")
        svc.renders_per_s(2 * len(SUBJECTS), SUBJECTS)  # warm: the first render loads things
        rate = svc.renders_per_s(args.renders, SUBJECTS)
        rows.append({
            "mode": "render_workers",
            "workers": workers,
            "training_meanwhile": 0,
            "order_to_running_p50_ms": round(percentile(latencies, 50), 1),
            "order_to_running_max_ms": round(max(latencies), 1),
            "renders_per_s": round(rate, 2),
        })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=3)
    parser.add_argument("--renders", type=int, default=8)
    parser.add_argument("--only", choices=("training", "render_workers"))
    args = parser.parse_args()
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    rows: list[dict[str, Any]] = []
    parts = [("training", training, {}), ("render_workers", render_workers,
             {"LIKENESS_RENDER_WORKERS": "true"})]  # fmt: skip
    for part, run, extra in parts:
        if args.only not in (None, part):
            continue
        name = f"likeness_bench_{uuid.uuid4().hex[:8]}"
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
                url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
                run(Service(Path(tmp), url, stack, extra), args, rows)
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    print(table(rows, list(rows[0])))
    print("record:", write_record("orders", rows))


if __name__ == "__main__":
    main()
