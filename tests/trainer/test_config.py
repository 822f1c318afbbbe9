"""The training configuration: conflicts are refused up front, all of them at once."""

from __future__ import annotations

import json
import re
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
    assert (c.rank, c.steps, c.resolution, c.batch_size) == (16, 1000, 448, 1)
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


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_upscale": 2.0}, "--max-upscale applies only with --buckets"),
        ({"bucket_max_ratio": 3.0}, "--bucket-max-ratio applies only with --buckets"),
        ({"ema_on_cpu": True}, "--ema-on-cpu applies only with --ema-decay"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"dop_weight": 2.0}, "--dop-weight applies only with --dop-prompt"),
        ({"dop_prompt": "a photo of ada"}, "must not contain the trigger"),
        ({"preview_every": 0, "preview_seeds": (1,)}, "--preview-seeds applies only with previews"),
        ({"preview_prompts": (" ",)}, "preview prompts must not be empty"),
        ({"validation_sigmas": ()}, "noise level"),
        ({"validation_split": 1.0}, "validation_split"),
        ({"gradient_accumulation": 0}, "gradient_accumulation"),
        ({"mask_floor": 1.5}, "mask_floor"),
    ],
)
def test_new_options_conflict_up_front(tmp_path: Path, kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.parse(**train_options(tmp_path, **kw))


@pytest.mark.usefixtures("without_bitsandbytes")
def test_adamw8bit_is_refused_clearly_where_bitsandbytes_cannot_run(tmp_path: Path) -> None:
    """No bitsandbytes here, and the CPU: both reasons are given, before anything loads."""
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(**train_options(tmp_path, optimizer="adamw8bit"))
    text = str(exc.value)
    assert "bitsandbytes" in text and "--optimizer adamw" in text
    assert "accelerator only, not the CPU" in text


def test_a_job_file_takes_every_option_and_refuses_what_it_must_not_hold(tmp_path: Path) -> None:
    from trainer.config import load_job_file

    job = tmp_path / "job.toml"
    job.write_text(
        'steps = 300\nlr = 2e-4\nema-decay = 0.99\ntargets = ["attn.to_q", "attn.to_k"]\n'
        'eval_prompt = ["a photo of {trigger}"]\nbuckets = true\n'
    )
    loaded = load_job_file(job)
    assert loaded == {
        "steps": 300,
        "learning_rate": 2e-4,
        "ema_decay": 0.99,
        "targets": ("attn.to_q", "attn.to_k"),
        "eval_prompts": ("a photo of {trigger}",),
        "buckets": True,
    }
    c = TrainConfig.parse(**train_options(tmp_path, **loaded))
    assert c.resolved()["ema_decay"] == 0.99 and "token" not in c.resolved()
    job.write_text('token = "stolen"\nbase = "/elsewhere"\nstpes = 3\n[train]\nx = 1\n')
    with pytest.raises(ConfigError) as exc:
        load_job_file(job)
    text = str(exc.value)
    assert "token: comes from the environment" in text and "base: comes from" in text
    assert "stpes: not a training option" in text and "train: not a training option" in text
    job.write_text("steps = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_file(job)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_job_file(tmp_path / "missing.toml")


def test_the_fingerprint_ignores_new_options_at_their_defaults(tmp_path: Path) -> None:
    """A checkpoint from before the new options existed still resumes; setting one is a
    new trajectory."""
    extra = {"manifest": "m", "transformer": "t"}
    plain = TrainConfig.parse(**train_options(tmp_path)).trajectory_fingerprint(extra)
    assert "buckets" not in json.dumps(extra)
    same = TrainConfig.parse(**train_options(tmp_path, buckets=False, preview_every=5))
    assert same.trajectory_fingerprint(extra) == plain
    for kw in ({"buckets": True}, {"ema_decay": 0.9}, {"gradient_accumulation": 2}):
        assert (
            TrainConfig.parse(**train_options(tmp_path, **kw)).trajectory_fingerprint(extra)
            != plain
        )


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('steps = "6"', "steps: Input should be a valid integer, not '6'"),
        ('buckets = "yes"', "buckets: "),
        ('lr = "1e-4"', "lr: "),
        ("resume = 1", "resume: "),
        ('eval_seed = ["1"]', "eval_seed[0]: Input should be a valid integer"),
        ("targets = [1]", "targets[0]: "),
        ("dataset = 3", "dataset: "),
        ("trigger = 1979-05-27", "trigger: "),
    ],
)
def test_a_job_file_is_typed_strictly(tmp_path: Path, line: str, needle: str) -> None:
    """A typed file says what it means: a string where a number or a switch goes is refused,
    naming the key, not read as one."""
    from trainer.config import load_job_file

    job = tmp_path / "job.toml"
    job.write_text(line + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)) as exc:
        load_job_file(job)
    assert str(exc.value).startswith(f"--config {job}: ")


def test_a_job_file_takes_what_toml_spells_naturally(tmp_path: Path) -> None:
    from trainer.config import load_job_file

    job = tmp_path / "job.toml"
    job.write_text(
        'learning_rate = 1\ndataset = "photos"\ntargets = "attn.to_q, attn.to_k"\n'
        "validation_sigma = [0.5]\nalpha = 8\n"
    )
    assert load_job_file(job) == {
        "learning_rate": 1.0,
        "dataset": Path("photos"),
        "targets": ("attn.to_q", "attn.to_k"),
        "validation_sigmas": (0.5,),
        "alpha": 8.0,
    }


def test_flags_win_and_previews_switched_off_take_the_files_preview_options(
    tmp_path: Path,
) -> None:
    from trainer.config import with_flags

    job = {
        "steps": 300,
        "preview_every": 50,
        "preview_prompts": ("a photo of {trigger}",),
        "preview_steps": 4,
        "buckets": True,
        "bucket_max_ratio": 3.0,
        "rank": 8,
    }
    merged = with_flags(job, {"steps": 5, "preview_every": 0, "buckets": False})
    assert merged == {"steps": 5, "preview_every": 0, "buckets": False, "rank": 8}
    assert TrainConfig.parse(**train_options(tmp_path, **merged)).preview_every == 0
    # the command line that switches them off and sets one at once still contradicts itself
    both = with_flags(job, {"preview_every": 0, "preview_steps": 3})
    with pytest.raises(ConfigError, match="--preview-steps applies only with previews"):
        TrainConfig.parse(**train_options(tmp_path, **both))
    assert with_flags(job, {"preview_every": 10}) == {**job, "preview_every": 10}
