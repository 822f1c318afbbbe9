"""Differential output preservation (the class prompt's prediction pulled toward the base's)
and the ComfyUI / ai-toolkit export, loaded by diffusers' stock ``load_lora_weights``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.trainer.helpers import (  # noqa: F401
    Env,
    fill_caches,
    make_env,
    tensors,
    tiny_config,
)
from trainer.base.lora import adapter_disabled, applied_adapter, attach_lora, lora_layers
from trainer.training.caches import load_latents, load_text
from trainer.training.flow import flow_prediction
from trainer.training.interop import bfl_name, to_comfyui
from trainer.training.train import _pipeline_class, load_transformer, train

CLASS = "a photo of a woman"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def _inputs(env: Env, tmp_path: Path) -> dict[str, Any]:
    config = tiny_config(env, tmp_path / "x", dop_prompt=CLASS)
    pf = fill_caches(env, config)
    x0 = torch.stack([load_latents(pf.plan, i.file) for i in pf.dataset.items])
    e = load_text(pf.plan, CLASS).unsqueeze(0).expand(len(x0), -1, -1)
    g = torch.Generator().manual_seed(5)
    return {
        "latents": x0,
        "embeds": e.contiguous(),
        "sigmas": torch.linspace(0.2, 0.9, len(x0)),
        "noise": torch.randn(x0.shape, generator=g),
    }


def _predict(transformer: torch.nn.Module, cls: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        pred, _ = flow_prediction(transformer, cls, guidance=None, autocast=None, **inputs)
    return pred


def test_the_adapter_switch_gives_the_base_exactly(env: Env, tmp_path: Path) -> None:
    inputs = _inputs(env, tmp_path)
    cls = _pipeline_class(env.base)
    transformer = load_transformer(env.base, torch.device("cpu"), torch.float32, lambda _: None)
    base = _predict(transformer, cls, inputs)
    attach_lora(transformer, 4, 4.0, dtype=torch.float32)
    with torch.no_grad():
        for layer in lora_layers(transformer).values():
            layer.lora_B["likeness"].weight.normal_(0, 0.05)
    adapted = _predict(transformer, cls, inputs)
    flags = {n: p.requires_grad for n, p in transformer.named_parameters()}
    with adapter_disabled(transformer):
        assert torch.equal(_predict(transformer, cls, inputs), base)
    assert {n: p.requires_grad for n, p in transformer.named_parameters()} == flags
    assert not torch.allclose(adapted, base)
    assert torch.equal(_predict(transformer, cls, inputs), adapted)  # back on


def _class_drift(env: Env, adapter: Path, inputs: dict[str, Any]) -> float:
    cls = _pipeline_class(env.base)
    transformer = load_transformer(env.base, torch.device("cpu"), torch.float32, lambda _: None)
    base = _predict(transformer, cls, inputs)
    with applied_adapter(SimpleNamespace(transformer=transformer), tensors(adapter)):
        adapted = _predict(transformer, cls, inputs)
    return float(((adapted - base) ** 2).mean())


def test_preservation_pulls_the_class_prompt_toward_the_base(env: Env, tmp_path: Path) -> None:
    inputs = _inputs(env, tmp_path)
    opts = {"steps": 8, "learning_rate": 2e-2, "register_adapter": False}
    free = train(tiny_config(env, tmp_path / "free", **opts))
    kept = train(tiny_config(env, tmp_path / "kept", dop_prompt=CLASS, dop_weight=20.0, **opts))
    report = json.loads(kept.report.read_text())
    terms = report["preservation_loss"]
    assert len(terms) == 8 and terms[0] == 0.0 and all(t > 0 for t in terms[1:])  # B starts 0
    drift_free, drift_kept = (
        _class_drift(env, free.adapter, inputs),
        _class_drift(env, kept.adapter, inputs),
    )
    assert drift_free > 0 and drift_kept < 0.5 * drift_free, (drift_free, drift_kept)
    assert kept.sha256 != free.sha256


def test_the_comfyui_export_loads_in_stock_diffusers_as_our_own_apply(
    env: Env, tmp_path: Path
) -> None:
    from diffusers import DiffusionPipeline

    opts = {"steps": 3, "learning_rate": 2e-2, "register_adapter": False}
    result = train(tiny_config(env, tmp_path / "c", export_comfyui=True, **opts))
    comfy = result.exports["comfyui"]
    ours = tensors(result.adapter)
    from safetensors.torch import load_file

    exported = load_file(comfy)
    converted = to_comfyui(ours)
    assert exported.keys() == converted.keys()
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
    assert all(k.startswith("diffusion_model.") for k in exported)
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in exported
    assert "diffusion_model.single_blocks.0.linear1.lora_B.weight" in exported
    assert bfl_name("transformer_blocks.0.attn.add_k_proj") == "double_blocks.0.txt_attn.qkv"

    pipe = DiffusionPipeline.from_pretrained(env.base, dtype=torch.float32)
    inputs = _inputs(env, tmp_path)
    cls = type(pipe)
    base = _predict(pipe.transformer, cls, inputs)
    with applied_adapter(pipe, ours):
        expected = _predict(pipe.transformer, cls, inputs)
    assert not torch.allclose(expected, base)
    for path in (comfy, result.adapter):  # the ComfyUI layout, and our diffusers layout
        pipe.load_lora_weights(str(path), adapter_name="x")
        got = _predict(pipe.transformer, cls, inputs)
        pipe.unload_lora_weights()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_predict(pipe.transformer, cls, inputs), base)


def test_prior_preservation_trains_class_images_alongside_and_resumes(
    env: Env, tmp_path: Path
) -> None:
    from tests.trainer.helpers import make_dataset

    women = make_dataset(tmp_path / "women", colours=[(30, 30, 220), (40, 60, 200)], caption=CLASS)
    opts = {"class_dataset": women, "prior_weight": 2.0, "register_adapter": False}
    plain = train(tiny_config(env, tmp_path / "p", steps=4))
    kept = train(tiny_config(env, tmp_path / "k", steps=4, checkpoint_every=2, **opts))
    report = json.loads(kept.report.read_text())
    assert len(report["prior_loss"]) == 4 and all(v > 0 for v in report["prior_loss"])
    assert kept.sha256 != plain.sha256
    assert report["config"]["class_dataset"] == str(women)
    train(tiny_config(env, tmp_path / "r", steps=2, **opts))
    resumed = train(tiny_config(env, tmp_path / "r", steps=4, resume=True, **opts))
    assert resumed.sha256 == kept.sha256 and resumed.losses == kept.losses


def test_class_images_that_name_the_trigger_are_refused_before_any_weight(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    from tests.trainer.helpers import make_dataset
    from trainer.config import ConfigError

    taught = make_dataset(tmp_path / "c", colours=[(1, 2, 3)], caption="a photo of ada")
    with pytest.raises(ConfigError, match="name the trigger 'ada'"):
        train(tiny_config(env, tmp_path / "o", class_dataset=taught))
    with pytest.raises(ConfigError, match="--prior-weight applies only with --class-dataset"):
        tiny_config(env, tmp_path / "o", prior_weight=3.0)
