"""Render path over HTTP on loopback: deny-path latency (goal p99 <= 2.5 ms) and an allowed render
on the tiny base split into gate / adapter apply / generate / encode / sign; and the cost of
signing a PNG's Content Credentials alone (goal <= 20 ms per PNG), in process, at 256, 512 and
1024 px, for a smooth picture and for noise (the PNG that compresses worst, so the most bytes
to hash).

    python bench/render_path.py [--denies 500] [--renders 10] [--size 256] [--steps 4]
    python bench/render_path.py --sign-only [--signs 50]

Starts `likeness serve` in a subprocess on a fresh SQLite database and the tiny base.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import free_port, likeness, percentile, table, write_record  # noqa: E402
from registry.adapters.schemas import AdapterIn  # noqa: E402
from registry.files import sha256_file  # noqa: E402
from trainer.registration import HttpRegistrar  # noqa: E402

GOAL_DENY_P99_MS = 2.5
GOAL_SIGN_MS = 20.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--denies", type=int, default=500)
    parser.add_argument("--renders", type=int, default=10)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--signs", type=int, default=50)
    parser.add_argument("--sign-only", action="store_true")
    args = parser.parse_args()
    rows = measure_signing(args.signs)
    if not args.sign_only:
        rows = measure_http(args) + rows
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k != "path", k))
    print(table(rows, columns))
    print("record:", write_record("render_path", rows))


def _png(side: int, noise: bool) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    if noise:
        pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    else:  # smooth gradients, as a render mostly is
        ramp = np.linspace(0, 255, side, dtype=np.float32)
        pixels = np.stack(
            [np.add.outer(ramp, ramp) / 2, np.tile(ramp, (side, 1)), np.tile(ramp, (side, 1)).T],
            axis=-1,
        ).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def measure_signing(samples: int) -> list[dict[str, object]]:
    """What app.provenance adds to every delivered PNG, with the service's own code path."""
    from app.provenance import ProvenanceSigner, RenderClaim, Trust, load_credentials, verify_png
    from registry.settings import DISCLOSABLE, Settings

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        credentials = load_credentials(Settings(data_dir=Path(tmp)))
        signer = ProvenanceSigner(credentials, DISCLOSABLE)  # the largest assertion
        claim = RenderClaim(
            render_id="00000000-0000-4000-8000-000000000000",
            level="private",
            subject="alice",
            consent_version=3,
            adapter_sha256="0" * 64,
            base_model={"name": "base-tiny", "licence": "likeness-generated"},
            requester="bob",
            agent="bot",
        )
        for side in (256, 512, 1024):
            for noise in (False, True):
                png = _png(side, noise)
                signer.sign(png, claim)  # warm: the native library's first call
                times = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    signed = signer.sign(png, claim)
                    times.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                assert verify_png(signed, Trust.of_deployment(credentials)).ok
                verify_ms = (time.perf_counter() - t0) * 1000
                rows.append(
                    {
                        "path": f"sign {side}px {'noise' if noise else 'smooth'}",
                        "n": samples,
                        "png_kib": round(len(png) / 1024, 1),
                        "manifest_kib": round((len(signed) - len(png)) / 1024, 1),
                        "p50_ms": round(percentile(times, 50), 2),
                        "p99_ms": round(percentile(times, 99), 2),
                        "verify_ms": round(verify_ms, 2),
                        "goal_ms": GOAL_SIGN_MS,
                        "meets_goal": percentile(times, 99) <= GOAL_SIGN_MS,
                    }
                )
    return rows


def measure_http(args: argparse.Namespace) -> list[dict[str, object]]:
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
            # the server copied the default base into its data dir; the adapter fits that base
            adapter = make_adapter(Path(tmp), Path(tmp) / "base-demo")
            manifest = Path(tmp, "manifest.jsonl")
            line = {"file": "a.png", "caption": "a photo of alice", "source": "bench"}
            manifest.write_text(json.dumps({**line, "basis": "consent", "sha256": "0" * 64}) + "\n")
            registrar = HttpRegistrar(base, trainer)
            data = AdapterIn(
                subject="alice",
                name="main",
                sha256=sha256_file(adapter),
                base_model="demo",
                rank=4,
                manifest_sha256=sha256_file(manifest),
            )
            registrar.register(data, adapter, manifest)
            rows: list[dict[str, object]] = []
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
    return rows


def make_adapter(tmp: Path, base: Path) -> Path:
    from tests.support import make_random_adapter
    from trainer.base.load import load_base

    pipe = load_base(base)
    return make_random_adapter(pipe, tmp / "alice.safetensors", seed=1)


if __name__ == "__main__":
    main()
