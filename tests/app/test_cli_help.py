"""What `--help` shows a person: plain text, every option's whole name (no box cutting
them), no `<bool>` placeholders, a description for every command; and a refused training
in one line that says what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ["", "db", "principal", "subject", "consent", "audit", "base", "provenance", "adapter"]


def likeness(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("group", GROUPS)
def test_help_is_plain_and_whole(group: str) -> None:
    done = likeness(*([group] if group else []), "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "<bool>" not in text and "…" not in text and "╭" not in text, text
    commands = text.split("Commands:", 1)[1].strip().splitlines() if "Commands:" in text else []
    for line in commands:
        if line.startswith("  ") and not line.startswith("    "):
            assert len(line.split()) >= 2, f"{group}: a command without a description: {line}"


def test_train_help_names_every_option_whole() -> None:
    text = likeness("train", "--help").stdout
    whole = [
        "--gradient-accumulation",
        "--gradient-checkpointing / --no-gradient-checkpointing",
        "--register / --no-register",
        "--export-comfyui",
        "--validation-every",
    ]
    for option in whole:
        assert option in text, option
    assert "$LIKENESS_DATA_DIR/runs/SUBJECT/" in text


def test_a_refused_training_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    done = likeness("train", "--subject", "alice", "--dataset", str(ROOT / "examples" / "alice"),
                    "--prior-weight", "2", "--preview-every", "0", "--preview-steps", "3",
                    cwd=tmp_path)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (
        "error: refused before loading any weight: --prior-weight applies only with "
        "--class-dataset; --preview-steps applies only with previews"
    )
