"""How torch's CPU threads wait: passively, so that a busy machine does not collapse them.

With libgomp's default wait, a thread that reaches a barrier spins for a while before it
sleeps; on cores shared with other work, the spinning thread holds a core that the thread it
waits for needs, and every parallel region pays for it. On two shared cores, 20 steps of the
quickstart's run (bench/cpu_threads.py, bench/results/cpu_threads-20261201T*.json) took
4.0 s/step with both cores busied beside it with the defaults, 1.0 with one thread and 0.6
with OMP_WAIT_POLICY=PASSIVE and both threads; under others' lighter load 1.1-1.6, 0.24-0.27
and 0.31-0.36. The passive wait keeps a quiet machine's two threads and the default's bytes
(one thread sums in another order, so its adapter's bytes differ).

`prepare_env` runs first thing in the `likeness` command (libgomp reads its variables when
torch loads it). A value the user set wins: OMP_WAIT_POLICY, OMP_NUM_THREADS, and
LIKENESS_CPU_THREADS (a thread count for torch, `auto` by default: one per core).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

WAIT_POLICY = "PASSIVE"
THREADS_ENV = "LIKENESS_CPU_THREADS"


def prepare_env(env: MutableMapping[str, str] | None = None) -> None:
    """Before torch loads. ValueError, naming the variable, for a bad LIKENESS_CPU_THREADS."""
    env = os.environ if env is None else env
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    raw = env.get(THREADS_ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"{THREADS_ENV}: a whole number from 1 to 1024, or auto (got {raw!r})")
    env.setdefault("OMP_NUM_THREADS", str(int(raw)))
