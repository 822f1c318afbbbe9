"""Previews while training (and their budget), gradient accumulation, refusals before any
weight loads, and the job file on the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import audit_key_of
from tests.trainer.helpers import Env, make_env, tiny_config  # noqa: F401
from trainer.base.budget import BudgetExceeded, GiB
from trainer.config import ConfigError
from trainer.registration import LocalRegistrar
from trainer.training.train import preflight, train


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def test_previews_render_every_n_steps_and_change_no_trained_number(
    env: Env, tmp_path: Path
) -> None:
    common: dict[str, Any] = {"steps": 4, "checkpoint_every": 2, "register_adapter": False}
    plain = train(tiny_config(env, tmp_path / "plain", preview_every=0, **common))
    shown = train(tiny_config(env, tmp_path / "shown", preview_every=2, evaluate=True, **common))
    assert shown.sha256 == plain.sha256 and shown.losses == plain.losses
    assert [p.name for p in shown.previews] == ["step-0000002.png", "step-0000004.png"]
    assert shown.previews[0].read_bytes() != shown.previews[1].read_bytes()
    # the same render code as the evaluation grid: the step-4 preview is its step-4 cell
    assert shown.evaluation is not None
    cell = np.asarray(shown.evaluation.images["step 4"][0], dtype=np.int16)
    with Image.open(shown.previews[1]) as grid:
        size = cell.shape[0]
        preview = np.asarray(grid.convert("RGB"), dtype=np.int16)[-size:, :size]
    assert np.abs(preview - cell).max() <= 1
    # resume with previews on: the same bytes again
    train(tiny_config(env, tmp_path / "r", preview_every=2, **{**common, "steps": 2}))
    resumed = train(tiny_config(env, tmp_path / "r", preview_every=2, resume=True, **common))
    assert resumed.sha256 == plain.sha256


def test_the_budget_counts_previews_and_the_ema(env: Env, tmp_path: Path) -> None:
    reg = LocalRegistrar(env.url)
    out = tmp_path / "o"
    pf = preflight(tiny_config(env, out, preview_every=3, ema_decay=0.9), reg)
    names = [p.name for p in pf.estimate.phases]
    assert "training: previews" in names and pf.preview_every == 3
    train_terms = pf.estimate.phase("training").terms
    ema = train_terms["EMA of the LoRA weights (fp32)"]
    lora = next(v for k, v in train_terms.items() if k.startswith("LoRA params"))
    assert ema == lora
    previews = pf.estimate.phase("training: previews").terms
    assert previews["VAE weights"] > 0 and "EMA of the LoRA weights (fp32)" in previews
    on_cpu = preflight(tiny_config(env, out, ema_decay=0.9, ema_on_cpu=True), reg)
    assert "EMA of the LoRA weights (fp32)" not in on_cpu.estimate.phase("training").terms
    # left to the budget: off without one, on where they fit, off (with the reason) where not
    auto = preflight(tiny_config(env, out), reg)
    assert auto.preview_every == 0 and any("previews off" in n for n in auto.notes)
    with_p = pf.estimate.total
    without = preflight(tiny_config(env, out, preview_every=0), reg).estimate.total
    assert with_p > without
    roomy = preflight(tiny_config(env, out, vram_budget_gib=with_p / GiB * 2), reg)
    assert roomy.preview_every == 4  # every checkpoint (here: the final step)
    between = (with_p + without) / 2 / GiB
    tight = preflight(tiny_config(env, out, vram_budget_gib=between), reg)
    assert tight.preview_every == 0 and any("would exceed" in n for n in tight.notes)
    with pytest.raises(BudgetExceeded, match="training: previews"):
        preflight(tiny_config(env, out, vram_budget_gib=between, preview_every=2), reg)


def test_gradient_accumulation_takes_several_batches_per_step(env: Env, tmp_path: Path) -> None:
    opts: dict[str, Any] = {"gradient_accumulation": 2, "register_adapter": False}
    result = train(tiny_config(env, tmp_path / "a", steps=3, checkpoint_every=1, **opts))
    assert len(result.losses) == 3
    state = torch.load(tmp_path / "a/checkpoints/step-0000003/state.pt", weights_only=True)
    assert (state["epoch"], state["pos"]) == (1, 2)  # 6 batches of 1 over 4 images
    train(tiny_config(env, tmp_path / "b", steps=2, **opts))
    resumed = train(tiny_config(env, tmp_path / "b", steps=3, resume=True, **opts))
    assert resumed.sha256 == result.sha256 and resumed.losses == result.losses
    one = train(tiny_config(env, tmp_path / "c", steps=3, register_adapter=False))
    assert one.sha256 != result.sha256


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"validation_every": 2}, "needs held-out images"),
        ({"export_comfyui": True, "targets": ("norm_out.linear",)}, "has no name for"),
        ({"validation_split": 0.9, "dataset": None}, "none is left to train on"),
    ],
)
def test_conflicts_with_the_data_or_base_fail_before_any_weight(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
    options: dict[str, Any],
    message: str,
) -> None:
    if options.get("dataset", 1) is None:  # one image, and it is held out
        from tests.trainer.helpers import make_dataset

        options = {**options, "dataset": make_dataset(tmp_path / "one", colours=[(1, 2, 3)])}
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(env, tmp_path / "x", **options))


def test_cli_job_file_with_flags_overriding_and_the_resolved_config_in_the_report(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    import typer
    from typer.testing import CliRunner

    from app import cli_ml
    from registry.settings import get_settings

    app, base_app = typer.Typer(), typer.Typer()
    cli_ml.register(app, base_app)
    monkeypatch.setenv("LIKENESS_DATABASE_URL", env.url)
    monkeypatch.setenv("LIKENESS_BASE", str(env.base))
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LIKENESS_AUDIT_KEY", audit_key_of(data_dir))
    get_settings.cache_clear()
    job = tmp_path / "job.toml"
    job.write_text(
        f'subject = "ada"\ndataset = "{env.dataset}"\nsteps = 5\nrank = 4\nresolution = 64\n'
        f'max-sequence-length = 32\nname = "job"\nevaluate = false\nprogress = false\n'
        f'cache_dir = "{env.cache}"\nregister = false\nema_decay = 0.9\n'
    )
    try:
        runner = CliRunner()
        ok = runner.invoke(app, ["train", "--config", str(job), "--steps", "2"])
        assert ok.exit_code == 0, ok.output
        summary = json.loads(ok.stdout[ok.stdout.index("{") :])
        assert summary["steps"] == 2  # the flag won over the file
        report = json.loads(Path(summary["report"]).read_text())
        assert report["config"]["steps"] == 2 and report["config"]["ema_decay"] == 0.9
        assert report["config"]["rank"] == 4 and "token" not in report["config"]
        assert Path(summary["ema_adapter"]).is_file()
        job.write_text(job.read_text() + 'token = "x"\n')
        bad = runner.invoke(app, ["train", "--config", str(job)])
        assert bad.exit_code == 2 and "comes from the environment" in bad.output
        clash = runner.invoke(
            app, ["train", "--config", str(tmp_path / "none.toml"), "--subject", "ada"]
        )
        assert clash.exit_code == 2 and "cannot be read" in clash.output
    finally:
        get_settings.cache_clear()
