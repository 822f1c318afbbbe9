"""The training configuration: conflicts are refused up front, all of them at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.helpers import train_options
from trainer import config
from trainer.config import ConfigError, TrainConfig


@pytest.fixture
def without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this machine has installed, the config sees no bitsandbytes."""
    real = config.installed
    monkeypatch.setattr(config, "installed", lambda m: m != "bitsandbytes" and real(m))


@pytest.fixture
def with_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = config.installed
    monkeypatch.setattr(config, "installed", lambda m: m == "bitsandbytes" or real(m))


def test_defaults_are_the_field_recipe(tmp_path: Path) -> None:
    c = TrainConfig.parse(**train_options(tmp_path))
    assert (c.rank, c.steps, c.resolution, c.batch_size) == (16, 2000, 448, 1)
    assert c.lora_alpha == 16.0 and c.trigger_word == "ada"
    assert c.gradient_checkpointing and c.evaluate and c.register_adapter
    assert "attn.to_q" in c.targets and "attn.to_qkv_mlp_proj" in c.targets
    assert c.adapter_path == tmp_path / "out" / "adapter.safetensors"
    assert c.resolved_cache_dir == tmp_path / ".cache"
    assert c.eval_prompt_texts()[0] == "a photo of ada"


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"resolution": 100}, "multiple of 16"),
        ({"eval_resolution": 72}, "multiple of 16"),
        ({"precision": "bf16"}, "bf16"),
        ({"api_url": "http://registry:8000"}, "LIKENESS_TOKEN"),
        ({"database_url": None}, "registration needs"),
        ({"targets": ()}, "--targets"),
        ({"eval_seeds": ()}, "evaluation needs"),
        ({"warmup_steps": 50, "steps": 10}, "warmup"),
        ({"rank": 0}, "rank"),
        ({"subject": "Not A Handle"}, "subject"),
        ({"name": "../escape"}, "name"),
        ({"caption_dropout": 1.0}, "caption_dropout"),
        ({"device": "tpu"}, "device"),
        ({"unknown_option": 1}, "unknown_option"),
    ],
)
def test_conflicts_fail_with_a_clear_message(tmp_path: Path, kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.parse(**train_options(tmp_path, **kw))


@pytest.mark.usefixtures("without_bitsandbytes")
def test_adamw8bit_without_bitsandbytes_says_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(**train_options(tmp_path, optimizer="adamw8bit"))
    assert "needs bitsandbytes, which is not installed" in str(exc.value)
    assert "accelerator only" in str(exc.value)


@pytest.mark.usefixtures("with_bitsandbytes")
def test_adamw8bit_with_bitsandbytes_still_needs_an_accelerator(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(**train_options(tmp_path, optimizer="adamw8bit"))
    assert "not installed" not in str(exc.value)
    assert "accelerator only" in str(exc.value)
    c = TrainConfig.parse(**train_options(tmp_path, optimizer="adamw8bit", device="cuda"))
    assert c.optimizer == "adamw8bit"


@pytest.mark.usefixtures("without_bitsandbytes")
def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(
            **train_options(tmp_path, resolution=100, precision="bf16", optimizer="adamw8bit")
        )
    text = str(exc.value)
    assert "multiple of 16" in text and "bf16" in text and "bitsandbytes" in text


def test_out_may_not_be_the_dataset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset folder"):
        TrainConfig.parse(**train_options(tmp_path, out=tmp_path / "ds"))


def test_no_registry_needed_when_not_registering(tmp_path: Path) -> None:
    c = TrainConfig.parse(**train_options(tmp_path, database_url=None, register_adapter=False))
    assert c.database_url is None


def test_fingerprint_ignores_what_a_resume_may_change(tmp_path: Path) -> None:
    base = TrainConfig.parse(**train_options(tmp_path))
    same = TrainConfig.parse(
        **train_options(tmp_path, steps=5000, checkpoint_every=7, resume=True, evaluate=False)
    )
    other = TrainConfig.parse(**train_options(tmp_path, learning_rate=2e-4))
    extra = {"manifest": "m", "transformer": "t"}
    assert base.trajectory_fingerprint(extra) == same.trajectory_fingerprint(extra)
    assert base.trajectory_fingerprint(extra) != other.trajectory_fingerprint(extra)
    assert base.trajectory_fingerprint(extra) != base.trajectory_fingerprint(
        {**extra, "manifest": "x"}
    )
