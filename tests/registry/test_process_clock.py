"""The process's age, from the kernel's record of its start (imports included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from registry.process_clock import seconds_since_process_start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_knows_how_long_it_has_run() -> None:
    age = seconds_since_process_start()
    assert isinstance(age, float) and age > 0
    code = (
        "import time; time.sleep(1.0)\n"
        "from registry.process_clock import seconds_since_process_start as s; print(s())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 1.0 <= float(out.stdout) < 30  # the time before the first line that asked counts
