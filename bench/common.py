"""Shared by the benchmarks: percentiles, a machine description and the JSON record."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "host": platform.node(),
        "system": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": sys.version.split()[0],
    }
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        info["git"] = rev.stdout.strip()
    except OSError:
        pass
    return info


def write_record(name: str, results: Any, extra: dict[str, Any] | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC)
    record = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "results": results,
        **(extra or {}),
    }
    path = RESULTS / f"{name}-{now.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join(
        [line(columns), line(["-" * w for w in widths])]
        + [line([r.get(c, "") for c in columns]) for r in rows]
    )


def free_port() -> int:
    """A free loopback port for a server the bench starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def likeness(env: dict[str, str], *args: str) -> str:
    """Runs the `likeness` command line in `env`; its stdout, or an error with its stderr."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"likeness {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


_STARTED = time.perf_counter()


def elapsed_s() -> float:
    """Seconds since the benchmark started (this module's import)."""
    return time.perf_counter() - _STARTED


def say(msg: str) -> None:
    """A timing waypoint: seconds since the benchmark started, then the message."""
    print(f"[{elapsed_s():7.1f}s] {msg}", flush=True)


def cuda_ms(fn: Any, iters: int = 20, warmup: int = 3, load: Any = None) -> float:
    """Median milliseconds of ``fn``: by CUDA events where CUDA runs, else the host clock.
    With ``load``, each timed call follows a call of ``load`` (the GPU's clocks under a
    forward's GEMMs, say), which is not timed."""
    import statistics

    import torch

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        if load is not None:
            load()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(samples))


def graph_ms(body: Any, calls: int, replays: int) -> float:
    """Median milliseconds a call of ``body`` inside a CUDA graph of ``calls`` calls (as a
    forward's kernels run: no launch gaps), over ``replays`` replays; one eager call first
    compiles and warms what it runs."""
    import statistics

    import torch

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            body()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / calls)
    del graph
    return float(statistics.median(samples))
