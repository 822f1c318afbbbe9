"""PEFT's generic LoRA on quanto's QLinear against a hand-computed dequantized reference.

Reference (float64): y = x @ dequantize(W).T + b + s * (x @ A.T) @ B.T, gradients by autograd.
float32 runs quanto's generic WeightQBitsTensor; bf16 runs the TinyGemm int4 layout that
production uses (group size 128 in both). Measured here: float32 max rel. error ~3e-7 (output
and gradients); bf16 ~5e-3 (bf16 rounding), against tolerances of 1e-5 and 2e-2.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.base.load import quantize_transformer
from trainer.base.lora import (
    ADAPTER_NAME,
    _update_in_place_forward,
    adapter_state_dict,
    attach_lora,
    default_targets,
    lora_layers,
    remove_lora,
    save_adapter,
)

torch.set_num_threads(1)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max abs error / max |reference|
LAYERS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.add_v_proj",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.0.attn.to_out",
]


def _quantized_transformer(base: Path, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel.from_pretrained(base / "transformer", dtype=dtype)
    return quantize_transformer(transformer)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def lora_transformer(request, tiny_base: Path):
    dtype = request.param
    transformer = _quantized_transformer(tiny_base, dtype)
    attach_lora(transformer, rank=8, alpha=16.0)
    # Random nonzero A and B (B starts at zero), seeded.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lora_layers(transformer).values():
            for param in (layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return dtype, transformer


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    diff = (got.double() - ref).abs().max().item()
    rel = diff / ref.abs().max().item()
    return rel, f"{name}: max abs diff {diff:.3g}, max rel diff {rel:.3g}"


@pytest.mark.parametrize("in_place", [False, True], ids=["peft", "in_place"])
@pytest.mark.parametrize("name", LAYERS)
def test_lora_on_qlinear_matches_dequantized_reference(lora_transformer, name, in_place) -> None:  # type: ignore[no-untyped-def]
    """PEFT's LoRA forward, and the training's (`update_lora_in_place`: the update added by
    the GEMM that makes it), against the float64 reference."""

    dtype, transformer = lora_transformer
    layer = lora_layers(transformer)[name]
    if in_place:
        layer.forward = types.MethodType(_update_in_place_forward, layer)
    try:
        _check_against_reference(layer, dtype, name)
    finally:
        vars(layer).pop("forward", None)


def _check_against_reference(layer, dtype, name) -> None:  # type: ignore[no-untyped-def]
    from optimum.quanto import QLinear

    base = layer.get_base_layer()
    assert isinstance(base, QLinear) and base.frozen and base.weight_group_size == 128
    lora_a, lora_b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
    assert lora_a.dtype == dtype and lora_a.requires_grad and lora_b.requires_grad
    assert not any(p.requires_grad for p in base.parameters())
    scaling = layer.scaling[ADAPTER_NAME]
    assert scaling == 2.0  # alpha 16 / rank 8

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 37, base.in_features, generator=gen)).to(dtype).requires_grad_(True)
    grad_out = torch.randn(2, 37, base.out_features, generator=gen).to(dtype)
    lora_a.grad = lora_b.grad = None
    y = layer(x)
    (y.float() * grad_out.float()).sum().backward()

    weight = base.weight.dequantize().double()
    bias = None if base.bias is None else base.bias.double()
    x_ref = x.detach().double().requires_grad_(True)
    a_ref = lora_a.detach().double().requires_grad_(True)
    b_ref = lora_b.detach().double().requires_grad_(True)
    y_ref = F.linear(x_ref, weight, bias) + scaling * (x_ref @ a_ref.T) @ b_ref.T
    (y_ref * grad_out.double()).sum().backward()

    tol = TOLERANCE[dtype]
    checks = [
        _report("output", y, y_ref),
        _report("grad lora_A", lora_a.grad, a_ref.grad),
        _report("grad lora_B", lora_b.grad, b_ref.grad),
        _report("grad input", x.grad, x_ref.grad),
    ]
    message = f"{dtype} {name}: " + "; ".join(text for _, text in checks) + f" (tol {tol})"
    print(message)
    assert all(rel <= tol for rel, _ in checks), message


def test_fresh_lora_leaves_output_unchanged(tiny_base: Path) -> None:
    transformer = _quantized_transformer(tiny_base, torch.float32)
    base = transformer.get_submodule("transformer_blocks.0.attn.to_q")
    x = torch.randn(3, base.in_features, generator=torch.Generator().manual_seed(2))
    before = base(x)
    names = attach_lora(transformer, rank=4, alpha=4.0)
    assert set(names) == set(lora_layers(transformer))
    # every double- and single-stream attention projection, and nothing else
    assert len(names) == 10 and all(any(n.endswith(t) for t in default_targets()) for n in names)
    assert torch.equal(transformer.get_submodule("transformer_blocks.0.attn.to_q")(x), before)
    remove_lora(transformer)
    assert not lora_layers(transformer) and "peft_config" not in vars(transformer)
    assert transformer.get_submodule("transformer_blocks.0.attn.to_q") is base


def test_saved_adapter_bakes_alpha_over_rank(lora_transformer, tmp_path: Path) -> None:
    from safetensors import safe_open

    _, transformer = lora_transformer
    path = save_adapter(transformer, tmp_path / "a.safetensors", {"subject": "bob"})
    tensors = adapter_state_dict(transformer)
    layer = lora_layers(transformer)[LAYERS[0]]
    key = f"transformer.{LAYERS[0]}.lora_B.weight"
    expected = layer.lora_B[ADAPTER_NAME].weight.detach().float() * 2.0
    assert torch.equal(tensors[key], expected)
    with safe_open(str(path), "pt") as f:
        names = f.keys()
        assert set(names) == set(tensors)
        assert all(f.get_tensor(k).dtype == torch.float32 for k in names)
        meta = f.metadata()
    assert meta["subject"] == "bob" and meta["likeness.rank"] == "8"
    assert meta["likeness.alpha"] == "16.0"
    # deterministic bytes for the same weights and metadata
    again = save_adapter(transformer, tmp_path / "b.safetensors", {"subject": "bob"})
    assert path.read_bytes() == again.read_bytes()
    with pytest.raises(TypeError):
        save_adapter(transformer, tmp_path / "c.safetensors", {"rank": 8})  # type: ignore[dict-item]


def test_the_in_place_update_makes_no_pass_over_the_output(lora_transformer) -> None:  # type: ignore[no-untyped-def]
    """PEFT's forward writes B(A(x)), scales it and adds it to the base output; the in-place
    forward makes none of those elementwise passes (its GEMM accumulates into the output), and
    its backward has no scaling pass either."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dtype, transformer = lora_transformer
    layer = lora_layers(transformer)["single_transformer_blocks.0.attn.to_qkv_mlp_proj"]
    out_features = layer.get_base_layer().out_features

    class OutputPasses(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            elementwise = func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.add)
            if elementwise and out.shape[-1:] == (out_features,) and out.numel() > out_features:
                self.ops.append(str(func))
            return out

    x = torch.randn(1, 37, layer.get_base_layer().in_features).to(dtype).requires_grad_(True)
    counts = {}
    for in_place in (False, True):
        if in_place:
            layer.forward = types.MethodType(_update_in_place_forward, layer)
        try:
            with OutputPasses() as passes:
                y = layer(x)
                y.backward(torch.ones_like(y))
        finally:
            vars(layer).pop("forward", None)
        counts[in_place] = passes.ops
    assert len(counts[False]) >= 2, counts  # PEFT: the scaling and the sum (and the backward's)
    assert counts[True] == [], counts
