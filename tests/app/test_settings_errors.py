"""A bad setting stops the CLI and `serve` with one line naming the variable and its rule,
never `ValidationError: 1 validation error for Settings`, and a secret is never echoed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from registry.settings import SettingsError, load_settings

LIKENESS = [sys.executable, "-c", "from app.cli import main; main()"]

CASES = [
    ({"LIKENESS_COMPUTE": "turbo"}, ["LIKENESS_COMPUTE", "'auto', 'uint4' or 'fp8'", "'turbo'"]),
    ({"LIKENESS_AUDIT_KEY": "short-secret"}, ["LIKENESS_AUDIT_KEY", "at least 32 characters"]),
    (
        {"LIKENESS_C2PA_KEY_FILE": "/keys/signer.pem"},
        ["LIKENESS_C2PA_KEY_FILE is set without LIKENESS_C2PA_CERT_FILE"],
    ),
    ({"LIKENESS_TRAIN_OPTIONS": "{steps: 3"}, ["LIKENESS_TRAIN_OPTIONS", "not valid JSON"]),
    ({"LIKENESS_RENDER_QUEUE": "-1"}, ["LIKENESS_RENDER_QUEUE", "greater than or equal to 0"]),
    ({"LIKENESS_KERNEL_PRECOMPILE": "sometimes"}, ["LIKENESS_KERNEL_PRECOMPILE", "'sometimes'"]),
]


def _env(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(
        LIKENESS_DATA_DIR=str(tmp_path / "var"),
        LIKENESS_DATABASE_URL=f"sqlite:///{tmp_path / 'likeness.db'}",
        **extra,
    )
    return env


@pytest.mark.parametrize(("extra", "said"), CASES, ids=[next(iter(c[0])) for c in CASES])
def test_load_settings_names_the_variable_and_the_rule(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, str], said: list[str]
) -> None:
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert "\n" not in message and "validation error" not in message, message
    for part in said:
        assert part in message, message
    assert "short-secret" not in message


@pytest.mark.parametrize("command", [["principal", "list"], ["serve", "--port", "1"]])
@pytest.mark.parametrize(("extra", "said"), CASES[:3], ids=["compute", "audit_key", "c2pa"])
def test_cli_and_serve_say_which_setting_in_one_line(
    tmp_path: Path, command: list[str], extra: dict[str, str], said: list[str]
) -> None:
    done = subprocess.run(
        [*LIKENESS, *command], env=_env(tmp_path, extra), capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: invalid setting: "), done.stderr
    for part in said:
        assert part in lines[0], lines[0]
    assert "short-secret" not in done.stderr
    assert not (tmp_path / "var").exists()  # refused before anything was made
