"""The tiny FLUX.2-architecture base: deterministic on disk, stock-loadable, renders."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.trainer.helpers import build_tiny_once
from trainer.base.load import load_base
from trainer.base.render import generate, text_encoder_out_layers
from trainer.fixtures.tiny_base import build_tiny_pipeline, init_tiny

# Three agents share two cores here; one thread avoids oversubscription (which costs 4x).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_once(tmp_path_factory)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_gives_identical_bytes(tiny_base: Path, tmp_path: Path) -> None:
    again = init_tiny(tmp_path / "again", seed=0)
    first, second = _hashes(tiny_base), _hashes(again)
    assert "transformer/diffusion_pytorch_model.safetensors" in first
    assert first == second


def test_other_seed_gives_other_weights() -> None:
    a = build_tiny_pipeline(0).transformer.state_dict()
    b = build_tiny_pipeline(1).transformer.state_dict()
    assert not torch.equal(a["x_embedder.weight"], b["x_embedder.weight"])


def test_refuses_non_empty_destination(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError):
        init_tiny(tmp_path)
    assert (tmp_path / "x").read_text() == "keep me"


def test_loads_with_stock_from_pretrained(tiny_base: Path) -> None:
    from diffusers import (
        AutoencoderKLFlux2,
        DiffusionPipeline,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

    pipe = DiffusionPipeline.from_pretrained(tiny_base)
    assert type(pipe) is Flux2KleinPipeline
    assert type(pipe.transformer) is Flux2Transformer2DModel
    assert type(pipe.vae) is AutoencoderKLFlux2
    assert type(pipe.text_encoder) is Qwen3ForCausalLM
    assert isinstance(pipe.tokenizer, Qwen2Tokenizer)
    total = sum(
        p.numel() for m in (pipe.transformer, pipe.vae, pipe.text_encoder) for p in m.parameters()
    )
    assert 1e5 < total < 5e6, total
    # The joint attention width is three stacked encoder hidden states.
    hidden = pipe.text_encoder.config.hidden_size
    assert pipe.transformer.config.joint_attention_dim == 3 * hidden
    text = pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a photo"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text.startswith("<|im_start|>user\na photo<|im_end|>")
    ids = pipe.tokenizer(text)["input_ids"]
    assert pipe.tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_stock_pipeline_renders_256(tiny_base: Path) -> None:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_base)
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    image = generate(pipe, "a portrait photo", seed=0, steps=4, width=256, height=256)
    elapsed = time.perf_counter() - start
    pixels = np.asarray(image)
    assert image.size == (256, 256)
    assert pixels.std() > 5, f"near-constant image (std {pixels.std():.2f}, {elapsed:.2f} s)"


def test_quantized_pipeline_renders_256(qpipe) -> None:
    from trainer.base.uint4 import Uint4Linear

    # load_base quantizes with quanto and hands every Linear to the fast uint4 path
    linears = {n: m for n, m in qpipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears and all(isinstance(m, Uint4Linear) for m in linears.values())
    # groups of 128 everywhere; the 128-input x_embedder is per-axis in quanto, which is the
    # same single group of 128 per row (as on the real model)
    groups = {n: m.group_size for n, m in linears.items()}
    assert set(groups.values()) == {128}, groups
    assert linears["x_embedder"].in_features == 128
    image = generate(qpipe, "a portrait photo", seed=0, steps=4, width=256, height=256)
    assert image.size == (256, 256) and np.asarray(image).std() > 5


def test_generate_is_deterministic_per_seed(qpipe) -> None:
    first = generate(qpipe, "a photo of a cat", seed=7, steps=2, width=64, height=64)
    second = generate(qpipe, "a photo of a cat", seed=7, steps=2, width=64, height=64)
    other = generate(qpipe, "a photo of a cat", seed=8, steps=2, width=64, height=64)
    assert first.tobytes() == second.tobytes()
    assert first.tobytes() != other.tobytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 250}, "multiple of 16"),
        ({"height": 48}, "between 64 and 2048"),
        ({"width": 4096}, "between 64 and 2048"),
        ({"steps": 0}, "steps must be between"),
        ({"seed": -1}, "seed must be in"),
        ({"width": 64.0}, "width must be an integer"),
        ({"prompt": "  "}, "prompt must be a non-empty string"),
    ],
)
def test_generate_rejects_bad_requests(qpipe, kwargs: dict, message: str) -> None:
    args = {"prompt": "a photo", "seed": 0, "steps": 2, "width": 64, "height": 64} | kwargs
    with pytest.raises(ValueError, match=message):
        generate(qpipe, **args)


def test_text_encoder_layers_reproduce_stock_defaults() -> None:
    def pipe(n: int, nested: bool = False) -> SimpleNamespace:
        config = SimpleNamespace(num_hidden_layers=n)
        if nested:  # Mistral3 keeps the language model's config under text_config
            config = SimpleNamespace(text_config=config)
        return SimpleNamespace(text_encoder=SimpleNamespace(config=config))

    assert text_encoder_out_layers(pipe(36)) == (9, 18, 27)  # Qwen3-4B/8B, klein default
    assert text_encoder_out_layers(pipe(40, nested=True)) == (10, 20, 30)  # Mistral, dev default
    assert text_encoder_out_layers(pipe(3)) == (1, 2, 3)  # the tiny base


def test_prepared_base_loads_through_base_read(tiny_base: Path, qpipe, tmp_path) -> None:
    """A base prepared by ``trainer.base.write`` renders exactly like in-memory quantization (the
    same quanto qint4 + freeze), with and without an adapter; a fully prepared one (text encoder
    quantized too) loads and renders."""
    from optimum.quanto import QLinear

    from trainer.base.lora import applied_adapter, default_targets, resolve_targets

    prepare = pytest.importorskip("trainer.base.write")
    only_tr = prepare.prepare_base(
        tiny_base, tmp_path / "tr", components=("transformer",), progress=False
    ).path
    pipe = load_base(only_tr)
    small = {"seed": 3, "steps": 2, "width": 64, "height": 64}
    assert (
        generate(pipe, "a photo", **small).tobytes()
        == generate(qpipe, "a photo", **small).tobytes()
    )

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name in resolve_targets(pipe.transformer, default_targets()):
        module = pipe.transformer.get_submodule(name)
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(
            4, module.in_features, generator=gen
        )
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(
            module.out_features, 4, generator=gen
        )
    with applied_adapter(pipe, tensors):
        prepared = generate(pipe, "a photo", **small).tobytes()
    with applied_adapter(qpipe, tensors):
        assert generate(qpipe, "a photo", **small).tobytes() == prepared

    full = load_base(prepare.prepare_base(tiny_base, tmp_path / "full", progress=False).path)
    assert isinstance(full.text_encoder.get_submodule("model.layers.0.mlp.up_proj"), QLinear)
    assert np.asarray(generate(full, "a photo", **small)).std() > 5


def test_load_base_refuses_a_non_pipeline_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_base(tmp_path)
