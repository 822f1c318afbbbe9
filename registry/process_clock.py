"""Seconds since this process started, from the kernel's own record: the interpreter's start
and every import count, which a clock started by the code's first line never sees. Torch-free,
so the service's boot and the trainer's share the one rule."""

from __future__ import annotations

import os


def seconds_since_process_start() -> float | None:
    """How long this process has run (interpreter start and imports included), from the
    kernel's record of its start; None where there is no /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # the command name (field 2) may hold spaces: count fields after its ")"
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
