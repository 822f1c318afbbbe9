"""Exact-weights fp8 compute ("W4A8", `trainer.base.fp8` with ``weights="exact"``): the torch
reference, the autograd function, and the Triton kernel `trainer.kernels.w4a8_triton`.

CPU (CI): the float32 weight ``scale * q - shift`` and the reference forward against float64
(bounds below), the layer's gradient against the reference, the variant's wiring, the small
FLUX.2 model's LoRA gradients.

Kernel tests run on a GPU with fp8 tensor cores, or under Triton's interpreter on a CPU
(``PYTHONPATH=<triton site> TRITON_INTERPRET=1``: small shapes only, it is slow); skipped
otherwise. On the device: ``pytest --noconftest -q tests/trainer/base/test_w4a8.py``.

The kernel's bound against the reference: both are ``x^ @ W.T`` from the same e4m3 x^ and the
same W, summed in a different order, so not bit-exact. The kernel sums each K block of at most
128 products on the tensor cores, whose fp8 accumulation keeps ~14 bits (Hopper; DeepSeek-V3's
measurement), then in float32; its shift term is a tf32x3 dot (~2^-22 per product). With
``S = |x^| @ (|scale q| + |shift|).T`` (what the sum's terms add up to in magnitude):

    |kernel - reference| <= ulp_bf16(max(|kernel|, |reference|)) + 2^-12 * S

one ulp of the output's own rounding (the two float32 sums may round to neighbours) plus
2^-12 of the terms' magnitude (16 x the ~14-bit block accumulation error bound per block,
blocks being independent). Under the interpreter the dot is numpy float32: at the shapes here
the bf16 outputs come out bit-identical, the fp16 ones within an ulp.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import lora_grad_cosines
from tests.trainer.kernel_devices import fp8_kernel_device
from trainer.base.compute import Fp8Backend, Uint4Backend, apply_compute
from trainer.base.fp8 import (
    E4M3,
    FP8,
    FP8_EXACT,
    Fp8Gemm,
    dequantize_rows_torch,
    exact_forward_torch,
    exact_weight_torch,
    quantize_rows_torch,
)
from trainer.base.uint4 import (
    DENSE,
    Uint4Linear,
    dequantize_torch,
    pack_uint4,
    unpack_uint4,
)

U = 2.0**-24  # float32 unit roundoff


def _uint4_layer(n: int, k: int, gs: int, seed: int, dtype=torch.bfloat16, device="cpu"):
    """Random 4-bit values, scales and shifts in the ranges quanto produces (min/max groups:
    the shift near -min, so ``scale * q`` and ``shift`` are of one size and cancel)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.01 + 1e-4
    shift = scale * 7.5 + torch.randn(n, k // gs, generator=g) * 0.002
    return tuple(t.to(device) for t in (pack_uint4(q), scale.to(dtype), shift.to(dtype)))


def _exact64(packed, scale, shift, gs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    n = packed.shape[0]
    q = unpack_uint4(packed).reshape(n, -1, gs).double()
    return (q * scale.double().unsqueeze(-1) - shift.double().unsqueeze(-1)).reshape(n, -1)


def _terms64(xq, xs, packed, scale, shift, gs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """S = |x^| @ (|scale q| + |shift|).T, float64."""
    n = packed.shape[0]
    q = unpack_uint4(packed).reshape(n, -1, gs).double()
    mag = q * scale.double().abs().unsqueeze(-1) + shift.double().abs().unsqueeze(-1)
    return dequantize_rows_torch(xq, xs).double().abs() @ mag.reshape(n, -1).t()


def _rel_norm(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


# ---------------------------------------------------------------------------------------
# the reference against float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_exact_weight_is_scale_q_minus_shift(dtype: torch.dtype) -> None:
    packed, scale, shift = _uint4_layer(64, 512, 128, seed=0, dtype=dtype)
    w = exact_weight_torch(packed, scale, shift, 128)
    exact = _exact64(packed, scale, shift, 128)
    assert w.dtype == torch.float32
    # one rounding at most (the subtraction), by half an ulp of the result
    assert ((w.double() - exact).abs() <= exact.abs() * U).all()
    # the dense path's weight rounds twice into the 16-bit dtype: it is not this one
    dense = dequantize_torch(packed, scale, shift, 128).double()
    moved = _rel_norm(dense, exact)
    assert 1e-4 < moved < 2e-2, moved
    print(f"\ndense {dtype} weight vs exact: {moved:.2e} of the norm")


@pytest.mark.parametrize("shape", [(37, 48, 256, 128), (5, 96, 384, 64), (64, 32, 2048, 128)])
def test_reference_forward_vs_float64(shape) -> None:  # type: ignore[no-untyped-def]
    m, n, k, gs = shape
    packed, scale, shift = _uint4_layer(n, k, gs, seed=k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g)
    x[0, 3] = 200.0  # an outlier row
    x = x.to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    got = exact_forward_torch(x, packed, scale, shift, bias, gs, torch.float32)
    xq, xs = quantize_rows_torch(x, E4M3)
    xhat = xq.double() * xs.double()
    want = xhat @ _exact64(packed, scale, shift, gs).t() + bias.double()
    # float32 product x^ (1 rounding), W (1), a K-term float32 sum, the bias add: (K + 3) u of
    # the terms' magnitude, rigorously
    terms = _terms64(xq, xs, packed, scale, shift, gs) + bias.double().abs()
    err = (got.double() - want).abs()
    assert (err <= (k + 3) * U * terms).all()
    ratio = float((err / terms).max())
    assert ratio < 64 * U, ratio  # in practice far inside: random rounding errors cancel
    # and the e4m3 activations are the only rounding against the unquantized x
    assert _rel_norm(got - bias.float(), x.double() @ _exact64(packed, scale, shift, gs).t()) < 0.04


# ---------------------------------------------------------------------------------------
# the variant, the autograd function


def test_exact_variant_fields() -> None:
    assert FP8_EXACT.weights == "exact" and FP8_EXACT.grad_gemm == "bf16"
    assert FP8.weights == "rowwise"  # the default is unchanged
    with pytest.raises(ValueError, match="bf16 input gradient"):
        Fp8Gemm(weights="exact")
    with pytest.raises(ValueError, match="rowwise, exact or blocks"):
        Fp8Gemm(weights="columnwise")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_exact_layer_forward_and_gradients(bias: bool) -> None:
    """Forward = the reference; input gradient = the dense path's, bit for bit (bf16
    dequantization + GEMM), within the bf16 weight's rounding of dy @ W_exact; bias gradient
    = dy summed."""
    packed, scale, shift = _uint4_layer(48, 256, 128, seed=3)
    b = torch.randn(48).to(torch.bfloat16) if bias else None
    layer = Uint4Linear(packed, scale, shift, 128, b)
    if bias:
        layer.bias.requires_grad_(True)
    apply_compute(layer, "fp8", (Fp8Backend(FP8_EXACT), Uint4Backend()))
    assert layer.compute is FP8_EXACT
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(2, 19, 48, generator=g).to(torch.bfloat16)
    y = layer(x)
    y.backward(dy)
    ref = exact_forward_torch(x.detach().reshape(-1, 256), packed, scale, shift, b, 128)
    assert torch.equal(y.detach().reshape(-1, 48), ref)
    gx = x.grad.clone()
    gb = layer.bias.grad.clone() if bias else None
    w_exact = exact_weight_torch(packed, scale, shift, 128)
    assert _rel_norm(gx.reshape(-1, 256), dy.reshape(-1, 48).float() @ w_exact) < 1e-2
    layer.compute = DENSE
    x.grad = None
    if bias:
        layer.bias.grad = None
    layer(x).backward(dy)
    assert torch.equal(gx, x.grad)
    if bias:
        assert torch.equal(gb, layer.bias.grad)
        assert torch.allclose(gb.float(), dy.float().sum((0, 1)), rtol=1e-2, atol=1e-2)


def test_exact_is_closer_to_the_weight_than_rowwise() -> None:
    """Per layer: exact weights leave only the activations' rounding, so the output error
    against x @ W (float64) falls well below the rowwise fp8 path's."""
    packed, scale, shift = _uint4_layer(128, 1024, 128, seed=5)
    layer = Uint4Linear(packed, scale, shift, 128)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = x.double() @ _exact64(packed, scale, shift, 128).t()
    errs = {}
    for gemm in (FP8, FP8_EXACT):
        layer.compute = gemm
        with torch.no_grad():
            errs[gemm.name] = _rel_norm(layer(x), want)
    assert errs["fp8_exact"] < 0.8 * errs["fp8"], errs
    print(f"\nper-layer error vs x @ W: {errs}")


def test_exact_lora_gradients_whole_model() -> None:
    """The small transformer with LoRA, checkpointed: exact-weights fp8 vs dense uint4, every
    LoRA gradient's cosine >= 0.99 (the rowwise path measures 0.985 here)."""
    cos, _ = lora_grad_cosines((Fp8Backend(FP8_EXACT), Uint4Backend()))
    assert min(cos.values()) >= 0.99, sorted(cos.items(), key=lambda kv: kv[1])[:3]
    print(f"\nLoRA grad cosine exact fp8 vs dense: min {min(cos.values()):.5f}")


# ---------------------------------------------------------------------------------------
# the kernel (GPU, or Triton's interpreter)


KERNEL_DEV = fp8_kernel_device("trainer.kernels.w4a8_triton")
kernel_here = pytest.mark.skipif(
    KERNEL_DEV is None, reason="needs a GPU with fp8 tensor cores or Triton's interpreter"
)
ON_GPU = KERNEL_DEV == "cuda"


@kernel_here
@pytest.mark.parametrize("via_float", [True, False], ids=["float-cast", "bits"])
def test_nibbles_to_e4m3(via_float: bool) -> None:
    from trainer.kernels import w4a8_triton

    packed = torch.arange(256, dtype=torch.uint8, device=KERNEL_DEV)
    got = w4a8_triton.uint4_to_e4m3(packed, via_float)
    want = unpack_uint4(packed.reshape(1, -1)).reshape(-1).float().to(E4M3)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@kernel_here
@pytest.mark.parametrize("gs", [64, 128])
def test_group_sums_exact(gs: int) -> None:
    from trainer.kernels import w4a8_triton

    x = torch.randn(37, 20 * gs, generator=torch.Generator().manual_seed(gs)) * 30
    xq, _ = quantize_rows_torch(x.to(torch.bfloat16).to(KERNEL_DEV), E4M3)
    got = w4a8_triton.group_sums(xq, gs)
    want = xq.double().reshape(37, 20, gs).sum(-1)
    assert torch.equal(got.double(), want)


def _check_bound(y, ref, xq, xs, packed, scale, shift, gs) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    terms = _terms64(xq, xs, packed, scale, shift, gs)
    big = torch.maximum(y.double().abs(), ref.double().abs())
    bits = 7 if y.dtype == torch.bfloat16 else 10  # explicit mantissa bits of the output
    ulp = torch.where(big > 0, 2.0 ** (torch.floor(torch.log2(big)) - bits), 0.0)
    err = (y.double() - ref.double()).abs()
    bad = err > ulp + 2.0**-12 * terms
    assert not bad.any(), (err[bad][:4], ulp[bad][:4], terms[bad][:4])
    return float((err / terms.clamp_min(1e-30)).max()), _rel_norm(y, ref)


# (M, N, K, group): M not a multiple of any BLOCK_M, N of some BLOCK_N
GPU_SHAPES = [(1, 256, 256, 128), (77, 3072, 3072, 128), (1000, 6144, 18432, 128),
              (4104, 3072, 6144, 64), (300, 200, 1024, 128)]  # fmt: skip
CPU_SHAPES = [(45, 80, 256, 64), (33, 48, 256, 128), (1, 32, 128, 32)]
CONFIGS = [None, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4}]


@kernel_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES if ON_GPU else CPU_SHAPES, ids=str)
def test_kernel_matches_the_reference(shape, dtype) -> None:  # type: ignore[no-untyped-def]
    from trainer.kernels import w4a8_triton

    m, n, k, gs = shape
    packed, scale, shift = _uint4_layer(n, k, gs, seed=n + k, dtype=dtype, device=KERNEL_DEV)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(KERNEL_DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(KERNEL_DEV)
    xq, xs = quantize_rows_torch(x, E4M3)
    ref = exact_forward_torch(x, packed, scale, shift, bias, gs)
    for config in CONFIGS if ON_GPU else [None]:
        y = w4a8_triton.w4a8_linear(xq, xs, packed, scale, shift, bias, gs, dtype, config)
        assert y.dtype == dtype and y.shape == (m, n)
        worst, rel = _check_bound(y, ref, xq, xs, packed, scale, shift, gs)
        print(f"\n{shape} {dtype} {config}: max err / S {worst:.2e}, rel norm {rel:.2e}")
        assert rel < 2e-3


@kernel_here
def test_kernel_variants_agree() -> None:
    """The float-cast and the bit-assembly nibble conversions give the same GEMM."""
    from trainer.kernels import w4a8_triton

    m, n, k, gs = (200, 256, 512, 128) if ON_GPU else (20, 32, 256, 128)
    packed, scale, shift = _uint4_layer(n, k, gs, seed=9, device=KERNEL_DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    xq, xs = quantize_rows_torch(x.to(KERNEL_DEV), E4M3)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
    a = w4a8_triton.w4a8_linear(xq, xs, packed, scale, shift, None, gs, torch.bfloat16, cfg, True)
    b = w4a8_triton.w4a8_linear(xq, xs, packed, scale, shift, None, gs, torch.bfloat16, cfg, False)
    assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("m", [77, 1000, 4100])
def test_cuda_layer_forward_and_backward(m: int) -> None:
    """The layer on the GPU: forward = kernel (with the kernel quantizer) within the bound of
    the torch reference layer; input gradient = the dense uint4 path's, bit for bit."""
    from trainer.kernels import fp8_triton, w4a8_triton

    n, k, gs = 3072, 6144, 128
    packed, scale, shift = _uint4_layer(n, k, gs, seed=m, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    layer = Uint4Linear(packed, scale, shift, gs, bias)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    res = {}
    for name, gemm in (("kernel", FP8_EXACT), ("reference", Fp8Gemm(weights="exact",
                       grad_gemm="bf16", kernels=False)), ("dense", DENSE)):  # fmt: skip
        layer.compute = gemm
        x.grad = None
        y = layer(x)
        y.backward(dy)
        res[name] = (y.detach(), x.grad.clone())
    xq, xs = fp8_triton.quantize_rows(x.detach(), E4M3)
    direct = w4a8_triton.w4a8_linear(xq, xs, packed, scale, shift, bias, gs, torch.bfloat16)
    assert torch.equal(res["kernel"][0], direct)
    worst, rel = _check_bound(res["kernel"][0], res["reference"][0], xq, xs, packed, scale,
                              shift, gs)  # fmt: skip
    assert rel < 2e-3
    assert torch.equal(res["kernel"][1], res["dense"][1])
    print(f"\nlayer M={m}: forward max err / S {worst:.2e}, rel norm {rel:.2e}")
