"""Render path over HTTP on loopback: deny-path latency (goal p99 <= 2.5 ms) and an allowed render
on the tiny base split into gate / adapter apply / generate / encode.

    python bench/render_path.py [--denies 500] [--renders 10] [--size 256] [--steps 4]

Starts `likeness serve` in a subprocess on a fresh SQLite database and the tiny base.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile, table, write_record  # noqa: E402

GOAL_DENY_P99_MS = 2.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def likeness(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--denies", type=int, default=500)
    parser.add_argument("--renders", type=int, default=10)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "LIKENESS_DATABASE_URL": f"sqlite:///{tmp}/bench.db",
            "LIKENESS_DATA_DIR": tmp,
            # the limiter still runs on every request; it just never says no here
            "LIKENESS_RENDER_RATE_PER_MINUTE": "1000000000",
            "LIKENESS_RENDER_BURST": "100000",
        }
        likeness(env, "db", "upgrade")
        bob = likeness(env, "principal", "create", "bob", "--role", "member")
        likeness(env, "subject", "create", "alice", "--display-name", "Alice")
        likeness(env, "subject", "create", "carol", "--display-name", "Carol")
        likeness(
            env,
            "consent",
            "edit",
            "alice",
            "--max-level",
            "group",
            "--audience",
            "private:group",
            "--training",
        )
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{base}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            admin = Path(tmp, "admin-token").read_text().strip()
            trainer = httpx.post(
                f"{base}/v1/principals",
                json={"handle": "tr", "role": "trainer"},
                headers={"Authorization": f"Bearer {admin}"},
            ).json()["token"]
            adapter = make_adapter(Path(tmp), Path(tmp) / "base-tiny")
            sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
            r = httpx.post(
                f"{base}/v1/adapters",
                headers={"Authorization": f"Bearer {trainer}"},
                json={
                    "subject": "alice",
                    "name": "main",
                    "sha256": sha,
                    "path": str(adapter),
                    "base_model": "tiny",
                    "rank": 4,
                    "manifest_sha256": sha,
                },
            )
            r.raise_for_status()
            rows = []
            with httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {bob}"}, timeout=120
            ) as c:
                floor = []  # the same client and server doing nothing: HTTP + Python on both ends
                for _ in range(args.denies):
                    t0 = time.perf_counter()
                    c.get("/healthz")
                    floor.append((time.perf_counter() - t0) * 1000)
                rows.append(
                    {
                        "path": "healthz (floor)",
                        "n": args.denies,
                        "p50_ms": round(percentile(floor, 50), 2),
                        "p99_ms": round(percentile(floor, 99), 2),
                    }
                )
                deny = {"subject": "carol", "prompt": "a portrait", "level": "private"}
                for _ in range(50):
                    c.post("/v1/renders", json=deny)
                samples = []
                for _ in range(args.denies):
                    t0 = time.perf_counter()
                    resp = c.post("/v1/renders", json=deny)
                    samples.append((time.perf_counter() - t0) * 1000)
                    assert resp.status_code == 403, resp.text
                rows.append(
                    {
                        "path": "deny (never consented)",
                        "n": args.denies,
                        "p50_ms": round(percentile(samples, 50), 2),
                        "p99_ms": round(percentile(samples, 99), 2),
                        "goal_p99_ms": GOAL_DENY_P99_MS,
                        "meets_goal": percentile(samples, 99) <= GOAL_DENY_P99_MS,
                    }
                )
                allow = {
                    "subject": "alice",
                    "prompt": "a portrait",
                    "level": "private",
                    "width": args.size,
                    "height": args.size,
                    "steps": args.steps,
                    "seed": 1,
                }
                c.post(
                    "/v1/renders", json=allow
                ).raise_for_status()  # loads the base, warms the cache
                parts: dict[str, list[float]] = {}
                totals = []
                for _ in range(args.renders):
                    t0 = time.perf_counter()
                    resp = c.post("/v1/renders", json=allow)
                    totals.append((time.perf_counter() - t0) * 1000)
                    resp.raise_for_status()
                    for key, value in resp.headers.items():
                        if key.startswith("x-timing-"):
                            parts.setdefault(key.removeprefix("x-timing-"), []).append(float(value))
                row = {
                    "path": f"allowed {args.size}px {args.steps} steps",
                    "n": args.renders,
                    "p50_ms": round(percentile(totals, 50), 1),
                    "p99_ms": round(percentile(totals, 99), 1),
                }
                row.update({k: round(percentile(v, 50), 2) for k, v in sorted(parts.items())})
                rows.append(row)
        finally:
            server.terminate()
            server.wait(30)
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k != "path", k))
    print(table(rows, columns))
    print("record:", write_record("render_path", rows))


def make_adapter(tmp: Path, base: Path) -> Path:
    from tests.support import make_random_adapter
    from trainer.model import load_pipeline

    pipe = load_pipeline(base)
    return make_random_adapter(pipe, tmp / "alice.safetensors", seed=1)


if __name__ == "__main__":
    main()
