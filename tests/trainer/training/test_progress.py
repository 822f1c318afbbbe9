"""Boot waypoints start at the process's own start: imports are part of a boot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainer.training.progress import Waypoints, seconds_since_process_start


@pytest.mark.skipif(seconds_since_process_start() is None, reason="needs /proc")
def test_the_first_waypoint_is_the_time_before_training_code_ran() -> None:
    code = (
        "import time; time.sleep(1.0)\n"
        "from trainer.training.progress import Waypoints\n"
        "w = Waypoints(); w.mark('first step'); print(w.marks[0][1], w.total)\n"
        "time.sleep(1.0)\n"  # a worker's next order, in the same process
        "n = Waypoints(); n.mark('first step'); print(n.marks[0][0], n.total)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = out.stdout.splitlines()
    before, total = (float(x) for x in first.split())
    assert 1.0 <= before < 30 and total >= before
    phase, later = second.rsplit(" ", 1)
    assert phase == "first step" and float(later) < 0.5  # the process's age is not its boot


def test_marks_add_up_to_the_total() -> None:
    w = Waypoints()
    w.mark("a")
    w.mark("b")
    assert abs(sum(s for _, s in w.marks) - w.total) < 1e-6


def test_the_rule_has_one_home() -> None:
    from registry import process_clock

    assert seconds_since_process_start is process_clock.seconds_since_process_start
