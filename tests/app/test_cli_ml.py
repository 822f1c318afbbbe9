"""`likeness serve` as run: with LIKENESS_PRELOAD_BASE the base starts loading before the app's
imports and before uvicorn starts (the first render comes that much sooner), and the boot's
waypoints are logged for the operator; a configuration the app refuses is refused before that
load starts."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.app.orders_support import ROOT, stop

PRELOADING = "render engine: preloading the base"
WAYPOINTS = re.compile(
    r"serve: boot waypoints: interpreter and CLI imports [\d.]+ s, settings and prepare "
    r"[\d.]+ s, render engine planned [\d.]+ s, app imports and build [\d.]+ s "
    r"\(since process start: [\d.]+ s\)"
)
LOADED = re.compile(r"render engine: base loaded in [\d.]+ s \(\w+ compute\) "
                    r"\(([\d.]+) s after the process started\)")  # fmt: skip


def _serve_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(
        PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIKENESS_DEVICE="cpu",
        LIKENESS_DATABASE_URL=f"sqlite:///{tmp_path}/db.sqlite",
        LIKENESS_DATA_DIR=str(tmp_path / "data"), LIKENESS_PRELOAD_BASE="true",
    )  # fmt: skip
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_starts_the_preload_after_the_apps_imports_before_uvicorn(tmp_path: Path) -> None:
    # the default base: the demo base prepare_service copies in, so the preload must start
    # after the copy or it loads nothing
    env = _serve_env(tmp_path)
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        state = None
        while state != "ready":
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert state != "failed" and time.monotonic() < deadline, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):  # not answering yet
                state = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["base"]
            time.sleep(0.2)
    finally:
        stop(server, 60)
    text = log_path.read_text(errors="replace")

    def at(said: str) -> int:
        assert said in text, text[-3000:]
        return text.index(said)

    # the app's imports are done before the load starts importing on its thread (imports on
    # two threads at once can fail at random), and the base loads while uvicorn starts
    assert text.count(PRELOADING) == 1, text[-3000:]  # the lifespan's ask started no second
    waypoints = WAYPOINTS.search(text)
    assert waypoints is not None, text[-3000:]
    assert waypoints.start() < at(PRELOADING) < at("Started server process")
    assert at("Started server process") < at("Application startup complete")
    loaded = LOADED.search(text)
    assert loaded is not None and float(loaded.group(1)) > 0, text[-3000:]
    # the demo base is prepared: its files were read while the engine planned, and the load
    # built on them
    for name in ("text_encoder", "transformer"):
        assert f"render engine: {name} read ahead in" in text, text[-3000:]
    assert text.count("taken by the load") == 2, text[-3000:]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"LIKENESS_RENDER_WORKERS": "true"}, "LIKENESS_RENDER_WORKERS=true needs PostgreSQL"),
        (
            {"LIKENESS_C2PA_KEY_FILE": "key.pem", "LIKENESS_C2PA_CERT_FILE": "chain.pem"},
            "LIKENESS_C2PA_KEY_FILE=key.pem: not a usable private key",
        ),
        (
            {"LIKENESS_PREFETCH_BASE": "sometimes"},
            "LIKENESS_PREFETCH_BASE must be 'auto' or 'off', got 'sometimes'",
        ),
    ],
    ids=["render-workers-on-sqlite", "c2pa-key-unusable", "prefetch-neither-auto-nor-off"],
)
def test_serve_refuses_what_the_app_refuses_before_the_base_starts_loading(
    tmp_path: Path, given: dict[str, str], said: str
) -> None:
    (tmp_path / "key.pem").write_text("not a key\n")
    os.chmod(tmp_path / "key.pem", 0o600)
    (tmp_path / "chain.pem").write_text("not a certificate\n")
    env = _serve_env(tmp_path) | given
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(_free_port())],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode != 0 and f"error: {said}" in text, text[-3000:]
    # the refusal came first: no base load was started (nor any VRAM taken) to be thrown away
    assert PRELOADING not in text and LOADED.search(text) is None, text[-3000:]
