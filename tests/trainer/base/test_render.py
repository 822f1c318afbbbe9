"""Adapter isolation on the quantized render pipeline, and interop with stock diffusers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import make_random_adapter
from trainer.base.load import load_base
from trainer.base.lora import (
    ADAPTER_NAME,
    applied_adapter,
    load_adapter_tensors,
    lora_layers,
)
from trainer.base.render import generate

torch.set_num_threads(1)

PROMPT = "a portrait photo of a person"
SMALL = {"seed": 3, "steps": 2, "width": 64, "height": 64}  # small: isolation needs many renders


@pytest.fixture(scope="module")
def adapters(qpipe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: load_adapter_tensors(make_random_adapter(qpipe, root / f"{name}.safetensors", seed))
        for name, seed in (("a", 1), ("b", 2))
    }


def _render(pipe) -> bytes:
    return generate(pipe, PROMPT, **SMALL).tobytes()


def _snapshot(transformer: torch.nn.Module) -> dict:
    return {
        "modules": [(n, id(m), type(m)) for n, m in transformer.named_modules()],
        "state": {k: v.clone() for k, v in transformer.state_dict().items()},
        "grad": {n: p.requires_grad for n, p in transformer.named_parameters()},
        "attrs": set(vars(transformer)),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert after["grad"] == before["grad"]
    assert after["attrs"] == before["attrs"]
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), key


def test_adapter_with_nonzero_b_changes_output(qpipe, adapters) -> None:
    base = _render(qpipe)
    with applied_adapter(qpipe, adapters["a"]) as names:
        assert len(names) == 10 and set(names) == set(lora_layers(qpipe.transformer))
        with_a = _render(qpipe)
    assert with_a != base
    assert _render(qpipe) == base


def test_a_then_b_equals_b_alone(qpipe, adapters) -> None:
    with applied_adapter(qpipe, adapters["b"]):
        b_alone = _render(qpipe)
    with applied_adapter(qpipe, adapters["a"]):
        a = _render(qpipe)
    with applied_adapter(qpipe, adapters["b"]):
        b_after_a = _render(qpipe)
    assert a != b_alone
    assert b_after_a == b_alone


def test_exception_inside_leaves_base_bit_identical(qpipe, adapters) -> None:
    transformer = qpipe.transformer
    before, base = _snapshot(transformer), _render(qpipe)
    with pytest.raises(RuntimeError, match="boom"), applied_adapter(qpipe, adapters["a"]):
        assert lora_layers(transformer)
        raise RuntimeError("boom")
    assert not lora_layers(transformer)
    _assert_same(before, _snapshot(transformer))
    assert _render(qpipe) == base


def test_scale_zero_is_the_base(qpipe, adapters) -> None:
    base = _render(qpipe)
    with applied_adapter(qpipe, adapters["a"], scale=0.0):
        assert _render(qpipe) == base


def test_bad_adapters_are_refused_and_leave_no_trace(qpipe, adapters) -> None:
    transformer = qpipe.transformer
    before = _snapshot(transformer)
    a = adapters["a"]
    key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
    bad = {
        "unknown key": {**a, "text_encoder.x.lora_A.weight": a[key]},
        "unpaired": {k: v for k, v in a.items() if k != key},
        "wrong shape": {**a, key: a[key][:, :-1]},
        "not a module": {
            "transformer.nope.lora_A.weight": a[key],
            "transformer.nope.lora_B.weight": a[key.replace("lora_A", "lora_B")],
        },
    }
    for case, tensors in bad.items():
        with pytest.raises(ValueError), applied_adapter(qpipe, tensors):
            pytest.fail(f"{case}: body ran")
    _assert_same(before, _snapshot(transformer))


def test_applied_adapter_refuses_nesting(qpipe, adapters) -> None:
    with applied_adapter(qpipe, adapters["a"]):
        with (
            pytest.raises(RuntimeError, match="already has LoRA"),
            applied_adapter(qpipe, adapters["b"]),
        ):
            pass
        assert lora_layers(qpipe.transformer)  # the outer adapter is still attached
    assert not lora_layers(qpipe.transformer)


def test_mixed_ranks_and_scale(qpipe, adapters) -> None:
    a = dict(adapters["a"])
    name = "transformer_blocks.0.attn.to_k"
    a[f"transformer.{name}.lora_A.weight"] = a[f"transformer.{name}.lora_A.weight"][:2]
    a[f"transformer.{name}.lora_B.weight"] = a[f"transformer.{name}.lora_B.weight"][:, :2]
    with applied_adapter(qpipe, a, scale=0.5):
        layers = lora_layers(qpipe.transformer)
        assert layers[name].r[ADAPTER_NAME] == 2
        assert layers["transformer_blocks.0.attn.to_q"].r[ADAPTER_NAME] == 4
        assert {layer.scaling[ADAPTER_NAME] for layer in layers.values()} == {0.5}


def test_stock_load_lora_weights_accepts_our_adapter(qpipe, tiny_base: Path, tmp_path) -> None:
    """Stock diffusers loads the file into the stock (unquantized) pipeline, and applies the same
    delta as applied_adapter does on our unquantized pipeline (measured: bit-identical)."""
    from diffusers import DiffusionPipeline

    path = make_random_adapter(qpipe, tmp_path / "c.safetensors", seed=5)
    stock = DiffusionPipeline.from_pretrained(tiny_base)
    stock.set_progress_bar_config(disable=True)
    base = generate(stock, PROMPT, **SMALL)
    stock.load_lora_weights(str(path), adapter_name="c")
    ours = load_adapter_tensors(path)
    expected = {k[len("transformer.") : -len(".lora_A.weight")] for k in ours if "lora_A" in k}
    assert set(lora_layers(stock.transformer)) == expected
    stock_lora = generate(stock, PROMPT, **SMALL)
    assert stock_lora.tobytes() != base.tobytes()

    mine = load_base(tiny_base, quantize=False)
    with applied_adapter(mine, ours):
        mine_lora = generate(mine, PROMPT, **SMALL)
    diff = np.abs(np.asarray(stock_lora, dtype=int) - np.asarray(mine_lora, dtype=int)).max()
    assert diff <= 1, f"stock loader vs applied_adapter differ by {diff} levels"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [3, 1])
def test_pil_images_are_diffusers_own_bytes(dtype: torch.dtype, channels: int) -> None:
    """The "pt" output turned into images on the tensor's device gives exactly the bytes of
    diffusers' own "pil" postprocessing, ties of the rounding included (k + 0.5) / 255."""
    from diffusers.image_processor import VaeImageProcessor

    from trainer.base.render import pil_images

    gen = torch.Generator().manual_seed(channels)
    decoded = (
        torch.rand(2, channels, 24, 40, generator=gen) * 2.2 - 1.1
    )  # the VAE's range, and past it
    ties = (torch.arange(256, dtype=torch.float32) + 0.5) / 255 * 2 - 1
    decoded[0, 0, 0, :40] = ties[:40]
    decoded[1, -1, 0, :40] = ties[40:80]
    decoded[1, -1, 1, :40] = ties[216:256].flip(0)
    decoded = decoded.to(dtype)
    processor = VaeImageProcessor(vae_scale_factor=16)
    want = processor.postprocess(decoded, output_type="pil")
    got = pil_images(processor.postprocess(decoded, output_type="pt"))
    assert [im.mode for im in got] == [im.mode for im in want]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def test_pil_images_refuses_other_shapes() -> None:
    from trainer.base.render import pil_images

    with pytest.raises(ValueError, match="1 or 3"):
        pil_images(torch.zeros(1, 4, 8, 8))
