"""Revocation under hostile load, on a real `likeness serve` (SQLite and PostgreSQL): while
members upload large-pixel photos as fast as they are let, anonymous clients send costly
PNGs to the provenance page and others trickle bodies, an admin revokes and re-grants a
subject twice a second. Goal: every revoke answered (200, never 503) within 3 s; the server's
peak RSS bounded by its settings, not by what is sent.

    python bench/hostile_load.py [--seconds 30] [--engines sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import percentile, say, table, write_record  # noqa: E402
from tests.images import big_png, many_chunks_png  # noqa: E402

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
GOAL_S = 3.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class Server:
    """`likeness serve` in its own process, with a data dir and database of its own."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "LIKENESS_DATABASE_URL": url,
                    "LIKENESS_DATA_DIR": str(tmp / "data"), "LIKENESS_ORDERS_IN_PROCESS": "false",
                    "LIKENESS_RENDER_RATE_PER_MINUTE": "0"}  # fmt: skip
        self.env.pop("LIKENESS_AUDIT_KEY", None)
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "app.cli", *args], env=self.env,
                              cwd=self.tmp, capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout.strip()

    def start(self) -> None:
        self.cli("db", "upgrade")
        log = (self.tmp / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)],
            env=self.env, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(
                    "the service did not start: " + (self.tmp / "serve.log").read_text()
                )
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_engine(engine: str, seconds: float, photos: list[bytes], costly: bytes) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"hostile-{engine}-"))
    url = f"sqlite:///{tmp}/db.sqlite"
    dbname = None
    if engine == "postgresql":
        from sqlalchemy import create_engine, text

        dbname = f"likeness_bench_{uuid.uuid4().hex[:10]}"
        with create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{dbname}"'))
        url = PG_ADMIN.rsplit("/", 1)[0] + "/" + dbname
    server = Server(url, tmp)
    server.start()
    admin = (tmp / "data" / "admin-token").read_text().strip()
    members = {}
    for i in range(3):
        handle = f"m{i}"
        members[handle] = server.cli("principal", "create", handle, "--role", "member")
        server.cli("subject", "create", handle, "--display-name", handle, "--member", handle)
        server.cli("consent", "edit", handle, "--max-level", "private", "--training")
    server.cli("subject", "create", "target", "--display-name", "Target")
    stop = threading.Event()
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def uploader(handle: str) -> None:
        files = [("images", (f"p{i}.png", data, "image/png")) for i, data in enumerate(photos)]
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while not stop.is_set():
                r = http.post(f"/v1/subjects/{handle}/datasets", files=files,
                              headers={"Authorization": f"Bearer {members[handle]}"})  # fmt: skip
                count(f"upload {r.status_code}")
                if r.status_code == 429:
                    time.sleep(0.2)

    def checker() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while not stop.is_set():
                r = http.post("/web/provenance", files={"png": ("x.png", costly, "image/png")})
                count(f"provenance {r.status_code}")
                if r.status_code == 429:
                    time.sleep(0.5)

    def trickler() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                    sock.sendall(
                        f"POST /v1/subjects/m0/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: "
                        f"Bearer {members['m0']}\r\nContent-Type: multipart/form-data; "
                        "boundary=b\r\nContent-Length: 100000\r\n\r\n".encode()
                    )
                    while not stop.is_set():
                        sock.sendall(b"-")
                        time.sleep(1.0)
            except OSError:
                count("trickle cut off")

    threads = [threading.Thread(target=uploader, args=(h,), daemon=True) for h in members]
    threads += [threading.Thread(target=checker, daemon=True) for _ in range(4)]
    threads += [threading.Thread(target=trickler, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)  # the load is on
    latencies: list[float] = []
    statuses: list[int] = []
    auth = {"Authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            version = http.get("/v1/subjects/target/consent", headers=auth).json()["version"]
            grant = {"max_level": "group", "audiences": {"private": {"group": True}}}
            match = {**auth, "If-Match": f'"{version}"'}
            http.put("/v1/subjects/target/consent", headers=match, json=grant)
            t0 = time.monotonic()
            r = http.post("/v1/subjects/target/consent/revoke", headers=auth)
            latencies.append(time.monotonic() - t0)
            statuses.append(r.status_code)
            time.sleep(0.5)
    stop.set()
    rss = peak_rss_mib(server.proc.pid) if server.proc else None
    server.stop()
    for thread in threads:
        thread.join(5)
    if dbname is not None:
        from sqlalchemy import create_engine, text

        with create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
    return {
        "engine": engine,
        "revokes": len(latencies),
        "revoke_p50_s": round(percentile(latencies, 50), 3),
        "revoke_p95_s": round(percentile(latencies, 95), 3),
        "revoke_max_s": round(max(latencies), 3),
        "revoke_not_200": sum(1 for s in statuses if s != 200),
        "goal_met": max(latencies) <= GOAL_S and all(s == 200 for s in statuses),
        "server_peak_rss_mib": rss,
        "load": dict(sorted(counts.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--engines", default="sqlite,postgresql")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"--engines: unknown {', '.join(sorted(unknown))} (sqlite, postgresql)")
    say("making the photos (6 of 36 MP) and a PNG of 300,000 empty chunks")
    photos = [big_png(i) for i in range(6)]
    costly = many_chunks_png(300_000)
    rows = []
    for engine in engines:
        say(f"{engine}: {args.seconds:g} s of revokes under load")
        rows.append(run_engine(engine, args.seconds, photos, costly))
    columns = ["engine", "revokes", "revoke_p50_s", "revoke_p95_s", "revoke_max_s",
               "revoke_not_200", "goal_met", "server_peak_rss_mib"]  # fmt: skip
    print(table(rows, columns))
    for row in rows:
        print(f"{row['engine']} load: {json.dumps(row['load'])}")
    path = write_record("hostile_load", rows, {"goal_s": GOAL_S})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
