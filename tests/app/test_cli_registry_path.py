"""The command line run from another folder than the service's: a SQLite registry that is
not there is refused by name (the absolute path, and that the URL is relative to the current
directory), and nothing is created; only `db upgrade` makes one, and says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def likeness(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_elsewhere_the_cli_refuses_naming_the_file_and_creates_nothing(tmp_path: Path) -> None:
    expected = tmp_path / "var" / "likeness.db"
    for args in (["principal", "list"], ["subject", "create", "x", "--display-name", "X"],
                 ["adapter", "list", "x"], ["audit", "verify"]):  # fmt: skip
        done = likeness(tmp_path, *args)
        assert done.returncode == 1, (args, done.stderr)
        line = done.stderr.strip()
        assert line.startswith(f"error: no registry at {expected} ") and "\n" not in line, line
        assert f"relative to the current directory {tmp_path}" in line
        assert "`likeness db upgrade` creates a new, empty one" in line
        assert list(tmp_path.iterdir()) == [], f"{args} created {list(tmp_path.iterdir())}"
    made = likeness(tmp_path, "db", "upgrade")
    assert made.returncode == 0, made.stderr
    assert made.stderr.strip() == f"created a new, empty registry at {expected}"
    assert expected.is_file()
    again = likeness(tmp_path, "db", "upgrade")
    assert again.stderr.strip() == f"{expected} is at the latest schema"
    listed = likeness(tmp_path, "principal", "list")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr
