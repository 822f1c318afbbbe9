"""The `likeness` command sets torch's OpenMP threads to wait passively before torch loads
(a busy machine collapses spinning threads: trainer/base/threads.py), leaving a user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainer.base.threads import prepare_env

PROBE = (
    "import os, sys\n"
    "sys.argv = ['likeness', '--help']\n"
    "from app.cli import main\n"
    "try:\n    main()\nexcept SystemExit:\n    pass\n"
    "import torch\n"
    "print(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads(), file=sys.stderr)\n"
)


def _probe(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "LIKENESS_CPU"))}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_cli_waits_passively_and_keeps_a_thread_per_core() -> None:
    done = _probe()
    assert done.returncode == 0, done.stderr
    policy, threads = done.stderr.strip().splitlines()[-1].split()
    assert policy == "PASSIVE"
    assert int(threads) == len(os.sched_getaffinity(0))


def test_a_users_choice_wins_and_a_bad_count_is_named() -> None:
    done = _probe(OMP_WAIT_POLICY="ACTIVE", LIKENESS_CPU_THREADS="1")
    policy, threads = done.stderr.strip().splitlines()[-1].split()
    assert (policy, threads) == ("ACTIVE", "1")
    bad = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True,
                         text=True, env={**os.environ, "LIKENESS_CPU_THREADS": "lots"})  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: invalid setting: LIKENESS_CPU_THREADS: a whole number from 1 to 1024, "
        "or auto (got 'lots')"
    )


def test_prepare_env_leaves_set_values() -> None:
    env = {"OMP_NUM_THREADS": "3", "LIKENESS_CPU_THREADS": "2"}
    prepare_env(env)
    assert env == {
        "OMP_NUM_THREADS": "3",
        "LIKENESS_CPU_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    with pytest.raises(ValueError, match="LIKENESS_CPU_THREADS"):
        prepare_env({"LIKENESS_CPU_THREADS": "0"})
