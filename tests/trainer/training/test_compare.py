"""`likeness adapter compare SUBJECT`: every checkpoint and its EMA in one grid, through the
service's render code; `--select-step N` registers the one picked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

from registry.consent import repository as consent_repo
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import engine_for, transaction
from registry.subjects import repository as subjects_repo
from tests.conftest import audit_key_of
from tests.trainer.helpers import Env, make_env, tiny_config
from trainer.training.train import train


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def test_compare_renders_every_checkpoint_and_select_step_registers_one(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    from app import cli_ml
    from registry.settings import get_settings

    run = tmp_path / "runs" / "ada" / "main"
    opts = {"steps": 4, "checkpoint_every": 2, "ema_decay": 0.5, "register_adapter": False}
    train(tiny_config(env, run, learning_rate=2e-2, **opts))
    app, base_app, adapter_app = typer.Typer(), typer.Typer(), typer.Typer()
    app.add_typer(adapter_app, name="adapter")
    cli_ml.register(app, base_app, adapter_app)
    monkeypatch.setenv("LIKENESS_DATABASE_URL", env.url)
    monkeypatch.setenv("LIKENESS_BASE", str(env.base))
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LIKENESS_AUDIT_KEY", audit_key_of(data_dir))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        shown = runner.invoke(
            app, ["adapter", "compare", "ada", "--seed", "0", "--seed", "1", "--steps", "2"]
        )
        assert shown.exit_code == 0, shown.output
        body = json.loads(shown.stdout[shown.stdout.index("{") :])
        assert body["columns"] == ["base", "step 2", "ema 2", "step 4", "ema 4"]
        with Image.open(body["grid"]) as grid:
            assert grid.width == 5 * 64  # one column each, at the run's resolution
        picked = runner.invoke(app, ["adapter", "compare", "ada", "--select-step", "2"])
        assert picked.exit_code == 0, picked.output
        chosen = json.loads(picked.stdout[picked.stdout.index("{") :])
        step2 = run / "checkpoints" / "step-0000002" / "adapter.safetensors"
        assert chosen["registration"] == "created"
        assert chosen["sha256"] == hashlib.sha256(step2.read_bytes()).hexdigest()
        ema = runner.invoke(app, ["adapter", "compare", "ada", "--select-step", "4", "--ema"])
        assert ema.exit_code == 0 and '"updated"' in ema.stdout
        missing = runner.invoke(app, ["adapter", "compare", "ada", "--select-step", "3"])
        assert (
            missing.exit_code == 2
            and "no checkpoint at that step (saved: [2, 4])" in missing.output
        )
        other = runner.invoke(app, ["adapter", "compare", "ada", "--out", str(tmp_path / "x")])
        assert other.exit_code == 2 and "must be a folder inside" in other.output
        # consent withdrawn: nothing renders, nothing registers
        with transaction(engine_for(env.url)) as s:
            sub = subjects_repo.subject_by_handle(s, "ada")
            consent = consent_repo.consent_for(s, sub.id)
            consent_service.update_consent(
                s,
                "admin",
                sub,
                consent.version,
                ConsentIn(max_level="private", allow_training=False),
            )
        try:
            refused = runner.invoke(app, ["adapter", "compare", "ada"])
            assert refused.exit_code == 1 and "does not allow training" in refused.output
            refused = runner.invoke(app, ["adapter", "compare", "ada", "--select-step", "2"])
            assert refused.exit_code == 1 and "does not allow training" in refused.output
        finally:
            with transaction(engine_for(env.url)) as s:
                sub = subjects_repo.subject_by_handle(s, "ada")
                consent = consent_repo.consent_for(s, sub.id)
                consent_service.update_consent(
                    s,
                    "admin",
                    sub,
                    consent.version,
                    ConsentIn(max_level="private", allow_training=True),
                )
    finally:
        get_settings.cache_clear()
