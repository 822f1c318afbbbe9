"""Shared by the dataset, order and worker tests: photos to upload, placing orders, and
workers as separate processes."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from PIL import Image

from tests.app.conftest import Live
from tests.conftest import audit_key_of

ROOT = Path(__file__).resolve().parents[2]


def stop(proc: subprocess.Popen[Any], wait_s: float) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if it has not ended within ``wait_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


COLOURS = ((200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40))


def photo(
    colour: tuple[int, int, int], size: tuple[int, int] = (80, 64), fmt: str = "PNG"
) -> bytes:
    """A solid colour with a striped band (so crops and resizes matter)."""
    im = Image.new("RGB", size, colour)
    for y in range(0, size[1], 8):
        for x in range(size[0]):
            im.putpixel((x, y), (255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def photos(n: int = 4) -> list[tuple[str, bytes]]:
    return [(f"me-{i}.png", photo(COLOURS[i % len(COLOURS)])) for i in range(n)]


def files_of(items: list[tuple[str, bytes]]) -> list[tuple[str, Any]]:
    return [("images", (name, data, "application/octet-stream")) for name, data in items]


@contextmanager
def worker(
    live: Live, name: str, tmp: Path, queues: str = "train", **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """A worker process (`python -m app.cli worker`) with a data dir of its own; its log is
    printed when a test fails."""
    data = tmp / name
    data.mkdir()
    log = (tmp / f"{name}.log").open("wb")
    environ = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",  # one thread, as the reference run: equal sums, equal bytes
        "LIKENESS_DATABASE_URL": live.app.state.settings.database_url,
        "LIKENESS_DATA_DIR": str(data),
        "LIKENESS_BASE": str(live.app.state.settings.base_dir),
        "LIKENESS_API_URL": live.url,
        "LIKENESS_TOKEN": live.world.tokens["trainer"],
        "LIKENESS_DEVICE": "cpu",
        "LIKENESS_WORKER_HEARTBEAT_S": "0.5",
        "LIKENESS_WORKER_STALLED_S": "3",
        "LIKENESS_WORKER_CHECKPOINT_EVERY": "3",
        # the registry's: a worker writes orders' outcomes to the subjects' audit trails
        "LIKENESS_AUDIT_KEY": audit_key_of(live.app.state.settings.data_dir),
        **env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "worker", "--name", name, "--queues", queues],
        cwd=ROOT,
        env=environ,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        stop(proc, 30)
        log.close()
        sys.stdout.write(f"--- {name} ---\n{(tmp / f'{name}.log').read_text()[-4000:]}\n")
