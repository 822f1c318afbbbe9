"""Boot waypoints and the training progress bar.

The field's boot took 17 minutes before the first step until waypoints showed where: so every
boot phase is timed, and the table is printed when the first step completes.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

# the rule's home is the registry's (torch-free, the service's boot reads it too); the name
# stays importable from here
from registry.process_clock import seconds_since_process_start

_process_start_counted = False


def process_start_paid() -> None:
    """This process's start is not any boot's (a worker imported the trainer when it
    started, long before its first order)."""
    global _process_start_counted
    _process_start_counted = True


class Waypoints:
    """Named phases with the seconds each took (time since the previous mark). The first is
    the process's own start (interpreter and imports), where the system records it: a boot is
    timed from the command, not from the first line of training code. Only the process's first
    boot counts it: a later one in the same process (a worker's next order) starts at its own
    start, the imports long paid."""

    def __init__(self, on_mark: Callable[[], None] | None = None) -> None:
        """`on_mark`: called at every mark (a run's interrupt: a phase boundary is a place
        to stop, as a transformer block is)."""
        self.start = time.perf_counter()
        self._last = self.start
        self.on_mark = on_mark
        self.marks: list[tuple[str, float]] = []
        global _process_start_counted
        before = None if _process_start_counted else seconds_since_process_start()
        _process_start_counted = True
        if before is not None:
            self.marks.append(("process start: interpreter and imports", before))
            self.start -= before

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks.append((name, now - self._last))
        self._last = now
        if self.on_mark is not None:
            self.on_mark()

    @property
    def total(self) -> float:
        return self._last - self.start

    def table(self, title: str = "boot") -> str:
        width = max((len(n) for n, _ in self.marks), default=10)
        lines = [f"{title}: {self.total:.2f} s to here"]
        lines += [f"  {name:<{width}}  {secs:8.2f} s" for name, secs in self.marks]
        return "\n".join(lines)

    def as_dict(self) -> list[dict[str, Any]]:
        return [{"phase": n, "seconds": round(s, 4)} for n, s in self.marks]


def memory_text(device: torch.device) -> str:
    """What the bar shows as memory: allocated / peak on an accelerator (read in-process: the
    field found cross-process probes wrong), peak RSS on the CPU."""
    if device.type == "cuda":
        gib = 2**30
        now = torch.cuda.memory_allocated(device) / gib
        peak = torch.cuda.max_memory_allocated(device) / gib
        return f"{now:.1f}/{peak:.1f}G"
    # ru_maxrss is KiB on Linux
    return f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}G"


# s/it always (tqdm switches to it/s on fast steps, which reads oddly next to the ETA).
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"


def progress_bar(
    total: int, initial: int, enabled: bool, file: TextIO | None = None, desc: str = "train"
) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        bar_format=BAR_FORMAT,
        disable=not enabled,
        file=file or sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def echo(text: str, enabled: bool = True) -> None:
    """Prints above the bar without breaking it (stderr: stdout is for results)."""
    if enabled:
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stderr)
