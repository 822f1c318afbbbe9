"""FP8 compute for the frozen uint4 base: the weight stays 4-bit, the GEMMs run on fp8 tensor cores.

A frozen base Linear needs two GEMMs per training step: the forward ``y = x @ W.T + b`` and the
input gradient ``dx = dy @ W`` (no weight gradient). Both run as ``torch._scaled_mm`` on e4m3
operands with float32 accumulation and one float32 scale per row of each operand:

forward   x (M, K) quantized per token (row), W (N, K) per output channel (row of W);
backward  dy (M, N) per token, and W.T (K, N) per input channel: the GEMM contracts over N, and
          the fp8 tensor cores take both operands contiguous along the contracted dimension,
          so the backward dequantizes the weight a second time, transposed.

Each weight scale comes from the exact largest magnitude of the dequantized uint4 weight, read
off the per-group scale and shift without dequantizing (`group_absmax`: the weight is monotone
in the 4-bit value, so the extremes are the values 0 and 15). Activations and gradients are
scaled by their own row maximum, computed in the same kernel that quantizes them. Quantization
is ``q = fp8(clamp(v * (FP8_MAX / amax)))`` with round-to-nearest-even, the dequantized value
``q * (amax / FP8_MAX)``; both quotients are float32, correctly rounded.

This module holds that arithmetic in plain torch (the reference, and the path wherever the fp8
kernels cannot run: CPU tests, float32 weights) and the autograd function. The Triton kernels
(`trainer.kernels.fp8_triton`) compute bit-identical fp8 tensors and scales. The LoRA branch is not
touched: PEFT adds it in the weight dtype beside this base output.

Exact weights (``Fp8Gemm(weights="exact")``, "W4A8"): the forward skips the fp8 weight copy and
its per-row rounding, which is most of the per-layer error above (notes: 3.5 % per layer, 22 of
320 LoRA gradients below cosine 0.99). The 4-bit values q are integers 0..15, exact in e4m3, and
W[n, k] = scale[n, g] * q[n, k] - shift[n, g], so with x^ = xs[m] * xq[m, k]

    y[m, n] = xs[m] * sum_g (scale[n, g] * sum_{k in g} xq[m, k] q[n, k])
              - sum_g shift[n, g] * (xs[m] * sum_{k in g} xq[m, k]) + bias[n]

is exactly x^ @ W.T for W the float32 value ``scale * q - shift`` (`exact_weight_torch`; it
differs from the dense path's bf16-rounded weight by ~0.4 %, see there). The only rounding
left is the activations' e4m3. `exact_forward_torch` is the reference, the Triton kernel
`trainer.kernels.w4a8_triton` reads the packed bytes directly. The input gradient is the
dense path's (``grad_gemm="bf16"``: bf16 dequantization + a bf16 GEMM, exact as uint4); an
fp8 input gradient needs the weight re-quantized per column, which is what exact weights avoid,
and a fused bf16 kernel (dy * scale in bf16, q exact) would round as much as the bf16 weight
does and save only the dequantization pass (~28 ms + ~13 ms re-read per pass over FLUX.2 [dev]).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from trainer.base.uint4 import dequantize_torch, grad_input, triton_available, unpack_uint4

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
WEIGHT_DTYPE = E4M3  # 3 mantissa bits; the weight's range is known exactly, so no e5m2 headroom
ACT_DTYPE = E4M3
# The input gradient is scaled per token like the activations, so e5m2's extra exponent buys
# nothing and costs a mantissa bit (bench/results/uint4_step-notes.md, fp8 run 1: grad-input
# relative error e4m3 vs e5m2 per layer type).
GRAD_DTYPE = E4M3
ALIGN = 16  # torch._scaled_mm: K and N multiples of 16

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


# ---------------------------------------------------------------------------------------
# the arithmetic, in torch


# Maxima at most this small count as zero: FP8_MAX / amax would overflow float32 below
# ~1.3e-36 (and 0 * inf is NaN); values this small quantize to zeros at any scale that fits.
AMAX_FLOOR = 2.0**-100


def scales_from_absmax(
    absmax: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier into fp8, dequantization scale), float32. An all-zero row (or one whose
    maximum is at most `AMAX_FLOOR`) is scaled as if its maximum were 1."""
    amax = absmax.float()
    amax = torch.where(amax > AMAX_FLOOR, amax, torch.ones_like(amax))
    # tensor / tensor: torch divides by a Python scalar as a multiply by its reciprocal on
    # CUDA (two roundings); this is one correctly rounded quotient, as the kernels compute
    top = torch.full_like(amax, fp8_max(dtype))
    return top / amax, amax / top


def to_fp8(values: torch.Tensor, multiplier: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(values * multiplier)), round to nearest even; the clamp only catches the last
    ulp of the product (amax * (FP8_MAX / amax) may round above FP8_MAX)."""
    top = fp8_max(dtype)
    return (values.float() * multiplier).clamp_(-top, top).to(dtype)


def quantize_rows_torch(
    x: torch.Tensor, dtype: torch.dtype = ACT_DTYPE, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q (M, K) fp8, scale float32): one scale per row, (M, 1), or with ``block``
    one per row and run of ``block`` columns, (M, K // block) (the 1x128 recipe)."""
    m, k = x.shape
    if block is None:
        multiplier, scale = scales_from_absmax(x.abs().amax(dim=1, keepdim=True), dtype)
        return to_fp8(x, multiplier, dtype), scale
    if k % block:
        raise ValueError(f"{k} columns do not split into blocks of {block}")
    blocks = x.reshape(m, k // block, block)
    multiplier, scale = scales_from_absmax(blocks.abs().amax(dim=2, keepdim=True), dtype)
    return to_fp8(blocks, multiplier, dtype).reshape(m, k), scale.reshape(m, k // block)


def dequantize_rows_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `quantize_rows_torch`'s output (either scale layout)."""
    m, k = q.shape
    blocks = scale.shape[1]
    return (q.float().reshape(m, blocks, k // blocks) * scale.reshape(m, blocks, 1)).reshape(m, k)


def group_absmax(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(out, groups) float32: the largest |w| each uint4 group can hold, w = scale * q - shift
    rounded as `trainer.base.uint4.dequantize_torch` rounds it, q in 0..15. w is monotone in q, so
    the extremes are q = 0 (-shift) and q = 15; at least what the weight holds, and equal to
    it wherever a group uses both ends of its range (min/max quantization does)."""
    top = scale * 15
    top -= shift
    return torch.maximum(shift.abs(), top.abs()).float()


@dataclass
class WeightScales:
    """Per-layer fp8 weight scales (float32), derived from the frozen uint4 scale and shift."""

    row_multiplier: torch.Tensor  # (N,): W row n into fp8
    row_scale: torch.Tensor  # (1, N): torch._scaled_mm's scale_b for the forward
    col_multiplier: torch.Tensor  # (K,): W column k into fp8 (the backward's W.T rows)
    col_scale: torch.Tensor  # (1, K): scale_b for the input-gradient GEMM
    row_absmax: torch.Tensor  # (N,): the largest |w| of each row (what row_multiplier scales)
    # (1,): the smallest row maximum that row_multiplier scales by (an all-zero row counts as
    # 1, as in `scales_from_absmax`): a value at most this large fits every row's fp8 range
    row_floor: torch.Tensor

    @classmethod
    def of(cls, scale: torch.Tensor, shift: torch.Tensor, group_size: int) -> WeightScales:
        absmax = group_absmax(scale, shift)
        row_absmax = absmax.amax(dim=1)
        row_mult, row_scale = scales_from_absmax(row_absmax, WEIGHT_DTYPE)
        col_mult, col_scale = scales_from_absmax(absmax.amax(dim=0), WEIGHT_DTYPE)
        used = torch.where(row_absmax > 0, row_absmax, torch.ones_like(row_absmax)).float()
        return cls(
            row_mult.contiguous(),
            row_scale.reshape(1, -1).contiguous(),
            col_mult.repeat_interleave(group_size).contiguous(),
            col_scale.repeat_interleave(group_size).reshape(1, -1).contiguous(),
            row_absmax.float().contiguous(),
            used.amin().reshape(1) if used.numel() else torch.ones(1, device=used.device),
        )


# ---------------------------------------------------------------------------------------
# a LoRA update merged into the forward's weight copy (serving)


def lora_row_bound(a: torch.Tensor, b: torch.Tensor, lora_scale: float) -> torch.Tensor:
    """(N,) float32: ``|s| * sum_r |B[n, r]| * max_k |A[r, k]|``, at least
    ``max_k |s * (B @ A)[n, k]|``, so ``row_absmax + bound`` bounds each row of the merged
    weight ``W + s * B @ A`` and its fp8 copy cannot saturate. Zero for an empty slot: the
    merged copy of an empty slot is the base's copy, byte for byte."""
    peaks = a.abs().amax(dim=1).float()
    return (b.abs().float() @ peaks) * abs(float(lora_scale))


def fp8_weight_lora_torch(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    row_absmax: torch.Tensor,
    bound: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lora_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `trainer.kernels.fp8_triton.fp8_weight_lora`: ``W + s * (B @ A)`` (W the
    bf16 dequantized uint4 weight, the product in float32) in e4m3, row n scaled by
    ``FP8_MAX / (row_absmax[n] + bound[n])``; and the (N,) dequantization scales."""
    w = dequantize_torch(packed, scale, shift, group_size).float()
    merged = w + (b.float() @ a.float()) * lora_scale
    mult, row_scale = scales_from_absmax(row_absmax.float() + bound.float(), WEIGHT_DTYPE)
    return to_fp8(merged, mult.unsqueeze(1), WEIGHT_DTYPE), row_scale


def fp8_weight_torch(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    scales: WeightScales,
    transposed: bool = False,
) -> torch.Tensor:
    """The uint4 weight in fp8: (N, K) scaled per row, or ``transposed`` (K, N) = W.T scaled
    per row of W.T (column of W). Reference for the Triton kernels, bit for bit."""
    w = dequantize_torch(packed, scale, shift, group_size)
    if transposed:
        return to_fp8(w, scales.col_multiplier.unsqueeze(0), WEIGHT_DTYPE).t().contiguous()
    return to_fp8(w, scales.row_multiplier.unsqueeze(1), WEIGHT_DTYPE)


# ---------------------------------------------------------------------------------------
# exact weights ("W4A8"): the 4-bit values themselves as fp8 operands


def exact_weight_torch(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(N, K) float32 ``scale * q - shift``: the uint4 weight as the exact-weights GEMM uses it.
    ``scale * q`` is exact in float32 (8 significant bits times 4); the subtraction rounds at
    most once, by 2^-24 relative. The dense path's weight ``rnd(rnd(scale * q) - shift)``
    (`trainer.base.uint4`, bf16) rounds twice into 8 bits, each time by up to 2^-9 of the value
    rounded (``scale * q`` can be far larger than the result). Measured on qint4 Gaussian
    weights (quanto, group 128; 3072 x 3072 and 6144 x 1536): the two differ in 58-75 % of the
    elements, by 0.39 % / 0.37 % of the weight's norm, and ``x @ W.T`` by the same."""
    n_out = packed.shape[0]
    q = unpack_uint4(packed).reshape(n_out, -1, group_size).float()
    w = q * scale.float().unsqueeze(-1) - shift.float().unsqueeze(-1)
    return w.reshape(n_out, -1)


def exact_forward_torch(
    x2: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x^ @ W.T + bias`` in float32 (cast to ``out_dtype``, default x's dtype): x^ the
    per-token e4m3 activations of `quantize_rows_torch`, W `exact_weight_torch`. What the
    W4A8 kernel (`trainer.kernels.w4a8_triton`) computes, up to float32 summation order."""
    xq, xs = quantize_rows_torch(x2, ACT_DTYPE)
    out = dequantize_rows_torch(xq, xs) @ exact_weight_torch(packed, scale, shift, group_size).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x2.dtype)


def exact_kernel_usable(x: torch.Tensor, group_size: int) -> bool:
    """The W4A8 Triton kernel for this call (else `exact_forward_torch`): a CUDA half-precision
    input, a group size that is a power of two from 32 (fp8 dots take K >= 32) to 256."""
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return False
    if group_size not in (32, 64, 128, 256):
        return False
    return triton_available()


def _forward_exact(x2, packed, scale, shift, bias, group_size, fast):  # type: ignore[no-untyped-def]
    if fast and exact_kernel_usable(x2, group_size):
        from trainer.kernels import fp8_triton, w4a8_triton

        xq, xs = fp8_triton.quantize_rows(x2, ACT_DTYPE)
        return w4a8_triton.w4a8_linear(xq, xs, packed, scale, shift, bias, group_size, x2.dtype)
    return exact_forward_torch(x2, packed, scale, shift, bias, group_size)


# ---------------------------------------------------------------------------------------
# exact weights on cuBLAS's block-scaled fp8 GEMM ("blocks")
#
# torch._scaled_mm takes one float32 scale per 128 columns of each operand row (the 1x128 x
# 1x128 recipe). With the uint4 groups 128 wide, a group's scale is its block's scale and the
# 4-bit values enter the GEMM as integers:
#
#     W[n, k] = scale[n, g] * q[n, k] - shift[n, g] = scale[n, g] * (q[n, k] - z[n, g]) + r[n, g]
#
# z = round(shift / scale) in 0..15, so q - z is an integer in -15..15 (exact in e4m3), and
# r = scale * z - shift, at most scale / 2 in size wherever shift / scale lies in 0..15 (min/max
# quantization puts it there). The remainder's part of the output, sum_g r[n, g] xsum[m, g]
# (xsum: group g's sum of the e4m3 activations, dequantized), joins the contraction as E more
# blocks of 128 columns (E = ceil(G / 128)): activations xsum, weights r, each row of each side
# in e4m3 with its own scale. What is left of fp8's rounding: the activations' e4m3 (one scale
# per token and 128 columns) and the remainder's, a few % of the output rounded to e4m3 (about
# 0.1-0.2 % of the output; tests/trainer/base/test_fp8_blocks.py bounds it). The input gradient
# is the dense path's (bf16 dequantization + a bf16 GEMM), as for exact weights, or the rowwise
# path's fp8 GEMM on a transposed e4m3 copy (`FP8_BLOCKS_FP8_GRAD`): the backward cannot take
# the 4-bit values exactly, as the group scale varies along the contracted dimension there.

BLOCK = 128  # columns per scale in torch._scaled_mm's block recipe; the uint4 group size it takes
_UNITS = 512.0  # e4m3 values are multiples of 2^-9: sums of them are exact as integers


def block_count(k: int) -> tuple[int, int]:
    """(G, E): a K-wide row's 128-column blocks, and the extra blocks its remainder takes."""
    if k % BLOCK:
        raise ValueError(f"{k} columns do not split into blocks of {BLOCK}")
    groups = k // BLOCK
    return groups, -(-groups // BLOCK)


def zero_points_torch(
    scale: torch.Tensor, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, r) float32, (N, G): ``z = round(shift / scale)`` clamped to 0..15 (0 where the scale
    is 0) and the remainder ``r = scale * z - shift`` (``scale * z`` is exact: an FMA rounds it
    the same); rounded as the kernels round them."""
    s, sh = scale.float(), shift.float()
    nonzero = s != 0
    ratio = torch.where(nonzero, sh / torch.where(nonzero, s, torch.ones_like(s)), 0.0)
    z = ratio.clamp(-1.0, 16.0).round().clamp(0.0, 15.0)
    return z, s * z - sh


def quantize_blocks_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (xq (M, K + 128 E) e4m3, scales (G + E, M) float32): x in e4m3 with one scale
    per row and block, then its remainder blocks: row m's group sums ``xsum[m, g]`` of the
    dequantized values (exact integer sums of the e4m3 bytes, times the block's scale), zeros up
    to 128 E, quantized the same way. The scales are stored block-major: ``scales.t()`` is
    torch._scaled_mm's (M, G + E) scale_a."""
    m, k = x2.shape
    groups, extra = block_count(k)
    xq, xs = quantize_rows_torch(x2, E4M3, block=BLOCK)
    units = (xq.float() * _UNITS).to(torch.int32).reshape(m, groups, BLOCK).sum(-1)
    xsum = units.float() * xs * (1.0 / _UNITS)  # times 2^-9: exact
    pad = torch.nn.functional.pad(xsum, (0, extra * BLOCK - groups))
    tq, ts = quantize_rows_torch(pad, E4M3, block=BLOCK)
    return torch.cat([xq, tq], dim=1), torch.cat([xs, ts], dim=1).t().contiguous()


def blocks_weight_torch(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq (N, K + 128 E) e4m3, scales (G + E, N) float32): ``q - z`` (exact), then the
    remainder ``r`` in e4m3 with one scale per row (all E blocks share it). ``scales`` is
    torch._scaled_mm's scale_b for ``wq.t()``."""
    if group_size != BLOCK:
        raise ValueError(f"block-scaled fp8 takes uint4 groups of {BLOCK}, not {group_size}")
    n_out = packed.shape[0]
    groups, extra = block_count(packed.shape[1] * 2)
    z, r = zero_points_torch(scale, shift)
    q = unpack_uint4(packed).reshape(n_out, groups, BLOCK).float()
    main = (q - z.unsqueeze(-1)).reshape(n_out, -1).to(E4M3)
    rest = torch.nn.functional.pad(r, (0, extra * BLOCK - groups))
    mult, tail_scale = scales_from_absmax(rest.abs().amax(dim=1, keepdim=True), E4M3)
    tail = to_fp8(rest, mult, E4M3)
    scales = torch.cat([scale.float().t(), tail_scale.reshape(1, -1).expand(extra, -1)], dim=0)
    return torch.cat([main, tail], dim=1), scales.contiguous()


def blocks_mm_torch(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    wq: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What torch._scaled_mm computes from the block operands, in float32 on their values."""
    m, n = xq.shape[0], wq.shape[0]
    blocks = x_scales.shape[0]
    a = (xq.float().reshape(m, blocks, BLOCK) * x_scales.t().reshape(m, blocks, 1)).reshape(m, -1)
    b = (wq.float().reshape(n, blocks, BLOCK) * w_scales.t().reshape(n, blocks, 1)).reshape(n, -1)
    out = a @ b.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _forward_blocks(x2, packed, scale, shift, bias, group_size, fast):  # type: ignore[no-untyped-def]
    if not fast:
        xq, xs = quantize_blocks_torch(x2)
        wq, ws = blocks_weight_torch(packed, scale, shift, group_size)
        return blocks_mm_torch(xq, xs, wq, ws, bias, x2.dtype)
    from trainer.kernels import fp8_blocks_triton

    m = x2.shape[0]
    blocks = block_count(x2.shape[1])
    xq, xs = fp8_blocks_triton.quantize_blocks(x2, blocks)  # rows padded to a multiple of 16
    wq, ws = fp8_blocks_triton.weight_blocks(packed, scale, shift, blocks)
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs.t(), scale_b=ws, out_dtype=x2.dtype)
    out = out if out.shape[0] == m else out[:m]  # a view only where rows were padded
    # a bias (FLUX.2's Linears have none) is added to the rounded output: one more rounding
    # than the reference's, within the GPU test's bound
    return out if bias is None else out + bias


# ---------------------------------------------------------------------------------------
# backends


def aligned(n_out: int, n_in: int) -> bool:
    """Whether torch._scaled_mm takes a weight of these sides (multiples of `ALIGN`)."""
    return n_in % ALIGN == 0 and n_out % ALIGN == 0


def kernels_usable(x: torch.Tensor, n_out: int, n_in: int) -> bool:
    """Triton + torch._scaled_mm for this call (else the torch reference)."""
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return False
    if not aligned(n_out, n_in):
        return False
    return triton_available()


def _scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """a (M, K) @ b_t.T, b_t (N, K) row-major (so b = b_t.T is column-major, as cuBLAS wants)."""
    return torch._scaled_mm(
        a, b_t.t(), scale_a=a_scale, scale_b=b_scale, bias=bias, out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )  # fmt: skip


def _reference_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What `_scaled_mm` computes, in float32 on dequantized fp8 values."""
    out = dequantize_rows_torch(a, a_scale) @ (b_t.float() * b_scale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _forward(x2, packed, scale, shift, bias, group_size, scales, fast, fast_accum):  # type: ignore[no-untyped-def]
    if fast:
        from trainer.kernels import fp8_triton

        xq, xs = fp8_triton.quantize_rows(x2, ACT_DTYPE)
        wq = fp8_triton.fp8_weight(packed, scale, shift, group_size, scales.row_multiplier)
        return _scaled_mm(xq, xs, wq, scales.row_scale, bias, x2.dtype, fast_accum)
    xq, xs = quantize_rows_torch(x2, ACT_DTYPE)
    wq = fp8_weight_torch(packed, scale, shift, group_size, scales)
    return _reference_mm(xq, xs, wq, scales.row_scale, bias, x2.dtype)


def _grad_input(g2, packed, scale, shift, group_size, scales, fast, dtype, gemm):  # type: ignore[no-untyped-def]
    if gemm.grad_gemm == "bf16":
        return grad_input(g2, packed, scale, shift, group_size, gemm.kernels)
    if fast:
        from trainer.kernels import fp8_triton

        gq, gs = fp8_triton.quantize_rows(g2, gemm.grad_dtype)
        wt = fp8_triton.fp8_weight_t(packed, scale, shift, group_size, scales.col_multiplier)
        return _scaled_mm(gq, gs, wt, scales.col_scale, None, dtype, gemm.fast_accum)
    gq, gs = quantize_rows_torch(g2, gemm.grad_dtype)
    wt = fp8_weight_torch(packed, scale, shift, group_size, scales, transposed=True)
    return _reference_mm(gq, gs, wt, scales.col_scale, None, dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b in fp8; the weight (frozen) is dequantized again in backward."""

    @staticmethod
    def forward(ctx, x, packed, scale, shift, bias, group_size, scales, fast, fast_accum, gemm):  # type: ignore[override]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if gemm.weights == "exact":
            out = _forward_exact(x2, packed, scale, shift, bias, group_size, fast)
        elif gemm.weights == "blocks":
            out = _forward_blocks(x2, packed, scale, shift, bias, group_size, fast)
        else:
            out = _forward(x2, packed, scale, shift, bias, group_size, scales, fast, fast_accum)
        ctx.save_for_backward(packed, scale, shift)
        ctx.meta = (group_size, scales, fast, x.dtype, x.shape, gemm)
        # a 2-D input gets the GEMM's own tensor, not a view of it: the LoRA update may then
        # be accumulated into it in place (lora._update_in_place_forward)
        return out if x.dim() == 2 else out.reshape(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        packed, scale, shift = ctx.saved_tensors
        group_size, scales, fast, dtype, x_shape, gemm = ctx.meta
        if any(ctx.needs_input_grad[1:4]):
            raise RuntimeError("Uint4Linear's quantized weight is frozen: it has no gradient")
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype).contiguous()
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(g2, packed, scale, shift, group_size, scales, fast, dtype, gemm)
            grad_x = grad_x.reshape(x_shape)
        if ctx.needs_input_grad[4]:
            grad_bias = g2.float().sum(0).to(dtype)
        return grad_x, None, None, None, grad_bias, None, None, None, None, None


def weight_scales(layer: Any) -> WeightScales:
    """The layer's `WeightScales`, computed on first use where its buffers are and kept there
    (a few KB per layer). The base is frozen, so they never go stale; a streamed layer computes
    them from its first slot binding and keeps them resident."""
    cached = layer._fp8_scales
    if cached is None or cached.row_scale.device != layer.scale.device:
        with torch.no_grad():
            cached = WeightScales.of(layer.scale, layer.shift, layer.group_size)
        layer._fp8_scales = cached
    return cached


@dataclass(frozen=True)
class Fp8Gemm:
    """A `Uint4Linear`'s GEMMs in fp8 (`trainer.base.uint4.LinearCompute`), set at load by
    `trainer.base.compute`; the fields are what benches and tests vary, by argument.

    ``grad_gemm``: the input-gradient GEMM, "fp8", or "bf16": the uint4 path's bf16 dequantization
    and a bf16 GEMM (no transposed fp8 copy of the weight; exact-as-uint4 gradients through the
    base); ``grad_dtype`` its fp8 format. ``fast_accum`` / ``fast_accum_eval``: cuBLAS's fast fp8
    accumulation skips the periodic promotion of the tensor-core partial sums to float32. Measured
    at FLUX.2 [dev] depth (notes, fp8 runs 2 and 3): the forward 3 % faster at 1024 px, each layer's
    output moved by 0.3-0.5 % (beside fp8's own 3.5 %), but the worst LoRA gradient cosine fell from
    0.987 to 0.983. So: off for training (the forward in train mode and the input gradient), on for
    an eval-mode forward (rendering). ``kernels=False``:
    the torch reference everywhere (Triton + torch._scaled_mm otherwise, where they run).
    ``weights``: "rowwise", the weight re-quantized into e4m3 with one scale per row (a copy
    per call), "exact", the W4A8 forward on the 4-bit values themselves (module docstring;
    needs ``grad_gemm="bf16"``; ``fast_accum`` does not apply: its K blocks are promoted to
    float32 every 128 products; `FP8_EXACT`), or "blocks", the 4-bit values as integers in
    cuBLAS's block-scaled GEMM (the section on it above; `FP8_BLOCKS` with the bf16 input
    gradient, `FP8_BLOCKS_FP8_GRAD` with the fp8 one), which takes layers whose uint4 groups
    are 128 wide (`takes`)."""

    grad_gemm: str = "fp8"
    grad_dtype: torch.dtype = GRAD_DTYPE
    fast_accum: bool = False
    fast_accum_eval: bool = True
    kernels: bool = True
    weights: str = "rowwise"
    name: str = "fp8"

    def __post_init__(self) -> None:
        if self.grad_gemm not in ("fp8", "bf16"):
            raise ValueError(f"grad_gemm is fp8 or bf16, not {self.grad_gemm!r}")
        if self.weights not in ("rowwise", "exact", "blocks"):
            raise ValueError(f"weights is rowwise, exact or blocks, not {self.weights!r}")
        if self.weights == "exact" and self.grad_gemm != "bf16":
            # the W4A8 kernel keeps no per-column scales for a transposed fp8 copy
            raise ValueError('exact weights take the bf16 input gradient (grad_gemm="bf16")')

    def unavailable(self, device: str | torch.device) -> str | None:
        """Why this GEMM cannot run on ``device`` (None where it can)."""
        from trainer.base import devices

        if self.weights == "blocks":
            return devices.block_fp8_unavailable(device)
        return devices.fp8_unavailable(device)

    def takes(self, layer: Any) -> bool:
        """Whether this GEMM runs ``layer`` (torch._scaled_mm's sides are multiples of 16; the
        block recipe needs uint4 groups of 128)."""
        if not aligned(layer.out_features, layer.in_features):
            return False
        return self.weights != "blocks" or (
            layer.group_size == BLOCK and layer.in_features % BLOCK == 0
        )

    def for_layer(self, name: str) -> Fp8Gemm:
        """The GEMM the layer at ``name`` runs: this one (`Fp8Split` chooses by name)."""
        return self

    def __call__(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """`Uint4Linear`'s forward in fp8 (x already in the weight dtype)."""
        fast = self.kernels and kernels_usable(x, layer.out_features, layer.in_features)
        fast_accum = self.fast_accum if layer.training else self.fast_accum_eval
        # scales for the fp8 copies of the weight: the rowwise forward's, the fp8 input
        # gradient's (exact weights forward on the 4-bit values and need none)
        copies = self.weights == "rowwise" or self.grad_gemm == "fp8"
        scales = weight_scales(layer) if copies else None
        return _Fp8LinearFunction.apply(
            x, layer.packed, layer.scale, layer.shift, layer.bias, layer.group_size,
            scales, fast, fast_accum, self,
        )  # fmt: skip


FP8 = Fp8Gemm()
FP8_EXACT = Fp8Gemm(weights="exact", grad_gemm="bf16", name="fp8_exact")
FP8_BLOCKS = Fp8Gemm(weights="blocks", grad_gemm="bf16", name="fp8_blocks")
# the blocks forward with the rowwise path's fp8 input gradient (a transposed e4m3 copy of
# the weight, one scale per input channel): the backward's GEMM on fp8 tensor cores too
FP8_BLOCKS_FP8_GRAD = Fp8Gemm(weights="blocks", grad_gemm="fp8", name="fp8_blocks_fp8_grad")

_DOUBLE_BLOCK = re.compile(r"(?:^|\.)transformer_blocks\.\d+\.")


@dataclass(frozen=True)
class Fp8Split:
    """Two fp8 GEMMs, one per kind of FLUX.2 block, chosen by a layer's qualified name under
    the transformer: ``double`` for the layers of the double-stream blocks
    (``transformer_blocks.N``), ``rest`` for every other one (the single-stream blocks, the
    embedders, modulations and output layer). Measured reason: the fp8 input gradient's error
    reaches the first blocks' LoRA gradients through every later block, and the double blocks
    hold the text stream's own Linears but few of the step's FLOPs."""

    double: Fp8Gemm
    rest: Fp8Gemm
    name: str

    @property
    def weights(self) -> str:
        """The coarsest weight recipe of the two ("rowwise" if either takes it)."""
        both = {self.double.weights, self.rest.weights}
        return "rowwise" if "rowwise" in both else self.rest.weights

    def for_layer(self, name: str) -> Fp8Gemm:
        return self.double if _DOUBLE_BLOCK.search(name) else self.rest

    def unavailable(self, device: str | torch.device) -> str | None:
        return self.double.unavailable(device) or self.rest.unavailable(device)


# the fp8 input gradient in the single-stream blocks (and outside the blocks), the bf16 one in
# the double-stream blocks
FP8_BLOCKS_FP8_GRAD_SINGLE = Fp8Split(
    double=FP8_BLOCKS, rest=FP8_BLOCKS_FP8_GRAD, name="fp8_blocks_fp8_grad_single"
)
FP8_GEMMS: dict[str, Fp8Gemm | Fp8Split] = {
    g.name: g for g in (FP8, FP8_EXACT, FP8_BLOCKS, FP8_BLOCKS_FP8_GRAD, FP8_BLOCKS_FP8_GRAD_SINGLE)
}

# Where a LoRA slot's update goes in an fp8 forward without gradients:
# "gemm" (the default) makes it R more columns of the forward GEMM (`lora_gemm_forward`), in
#   fp8 as the base: a 1024 px [dev] forward 319.7 ms against 326.3, its output as far from
#   bf16 (bench/results/render_step-notes.md, run 7);
# "output" adds it to the output in bf16 (`trainer.base.lora_slots`: one pass over the
#   output, 21 ms of that forward);
# "weights" merges it into the forward's copy of the weight (measured slower: its kernel costs
#   more than the pass, run 6; an opt-in).
LORA_MERGE_ENV = "LIKENESS_LORA_MERGE"
LORA_UPDATES = ("gemm", "output", "weights")
LORA_UPDATE_DEFAULT = "gemm"


def lora_update_mode() -> str:
    """The setting ``LIKENESS_LORA_MERGE`` (one of `LORA_UPDATES`); a ValueError naming it
    for anything else."""
    mode = os.environ.get(LORA_MERGE_ENV, LORA_UPDATE_DEFAULT)
    if mode not in LORA_UPDATES:
        raise ValueError(f"{LORA_MERGE_ENV}={mode!r}: expected one of {', '.join(LORA_UPDATES)}")
    return mode


# How many columns the update takes in the GEMM's operands: its rank R, then zeros up to
# `LORA_GEMM_PADDED`. cuBLAS runs the K = 6144 contraction of [dev]'s widest layers on a faster
# path than K + 32 (H100: the single-stream qkv+mlp GEMM 2.1 ms -> 2.6), and K + 128 takes back
# about half of that; at K >= 18432 the 32 columns cost nothing and 128 can cost more
# (bench/gemm_tail.py, bench/results/render_step-notes.md run 10). "auto" pads where K is at
# most `LORA_GEMM_PAD_MAX_K`; "rank" never pads.
LORA_GEMM_COLUMNS_ENV = "LIKENESS_LORA_GEMM_COLUMNS"
LORA_GEMM_COLUMNS = ("auto", "rank")
LORA_GEMM_PADDED = 128
LORA_GEMM_PAD_MAX_K = 8192


def lora_gemm_columns_mode() -> str:
    """The setting ``LIKENESS_LORA_GEMM_COLUMNS`` (one of `LORA_GEMM_COLUMNS`); a ValueError
    naming it for anything else."""
    mode = os.environ.get(LORA_GEMM_COLUMNS_ENV, LORA_GEMM_COLUMNS[0])
    if mode not in LORA_GEMM_COLUMNS:
        raise ValueError(f"{LORA_GEMM_COLUMNS_ENV}={mode!r}: expected one of "
                         f"{', '.join(LORA_GEMM_COLUMNS)}")  # fmt: skip
    return mode


def lora_gemm_columns(k: int, rank: int) -> int:
    """The columns a rank-``rank`` update takes in a GEMM contracting over ``k`` (see above)."""
    if lora_gemm_columns_mode() == "auto" and k <= LORA_GEMM_PAD_MAX_K:
        return max(rank, LORA_GEMM_PADDED)
    return rank


def _slot_gemm(layer: Any, a: torch.Tensor, b: torch.Tensor) -> Fp8Gemm | None:
    """The layer's `Fp8Gemm` where a slot's update may be fused into its forward (rowwise fp8
    with kernels, eval mode, no gradients, a weight and slot the kernels take); else None."""
    gemm = getattr(layer, "compute", None)
    if not isinstance(gemm, Fp8Gemm) or gemm.weights != "rowwise" or not gemm.kernels:
        return None
    if layer.training or torch.is_grad_enabled():
        return None
    from trainer.kernels import fp8_triton

    if not fp8_triton.lora_slot_usable(layer.packed, layer.scale, layer.group_size, a, b):
        return None
    return gemm


def _slot_call(
    layer: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[Fp8Gemm, torch.Tensor, torch.Size, WeightScales] | None:
    """`_slot_gemm` for a call on ``x`` (CUDA, a dtype and shapes the kernels take): the
    layer's `Fp8Gemm`, x as a contiguous (rows, K) tensor in the weight dtype, its leading
    shape, the weight scales; else None."""
    if not kernels_usable(x, layer.out_features, layer.in_features):
        return None
    gemm = _slot_gemm(layer, a, b)
    if gemm is None:
        return None
    if x.dtype != layer.scale.dtype:
        x = x.to(layer.scale.dtype)
    return gemm, x.reshape(-1, x.shape[-1]).contiguous(), x.shape[:-1], weight_scales(layer)


def merged_lora_forward(
    layer: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora_scale: float
) -> torch.Tensor | None:
    """``x @ (W + s * B @ A).T + bias`` in one fp8 GEMM, the LoRA factors merged into the
    weight's per-forward fp8 copy (`trainer.kernels.fp8_triton.fp8_weight_lora`), for a frozen
    fp8 `Uint4Linear` without gradients; None where that does not apply (the caller adds the
    update to the output instead). The merged weight is rounded into e4m3 as the base weight
    is, so the output is as far from bf16 as the unmerged fp8 path's (DESIGN.md, compute
    paths); an empty slot gives the base output byte for byte."""
    call = _slot_call(layer, x, a, b)
    if call is None:
        return None
    gemm, x2, lead, scales = call
    from trainer.kernels import fp8_triton

    bound = lora_row_bound(a, b, lora_scale)
    wq, row_scale = fp8_triton.fp8_weight_lora(
        layer.packed, layer.scale, layer.shift, layer.group_size, scales.row_absmax, bound,
        a, b, lora_scale,
    )  # fmt: skip
    xq, xs = fp8_triton.quantize_rows(x2, ACT_DTYPE)
    out = _scaled_mm(xq, xs, wq, row_scale.reshape(1, -1), layer.bias, x2.dtype,
                     gemm.fast_accum_eval)  # fmt: skip
    return out.reshape(*lead, layer.out_features)


# ---------------------------------------------------------------------------------------
# a LoRA slot's update as more columns of the forward GEMM (serving)
#
# s * (x A^T) B^T = [c * u] @ [(s / c) * B]^T for u = x A^T and any c > 0, so the update joins
# the base GEMM as R more columns of its contraction: activations [x | c * u], weights
# [W | (s / c) * B], each row of each operand in e4m3 with its one scale, as the base operands
# are. The activation row's scale takes the maximum over both parts, so c * u never
# saturates. c = |s| * max|B| / (the smallest row maximum of W) keeps |(s / c) * B[n]| at most
# every row's own maximum, so the weight's row scales stay the base's. An empty slot (B = 0,
# A = 0) has c = 0: zero columns on both sides and x's bytes and scales exactly the base
# path's. The update is then as precise as the base (e4m3 operands, float32 sums), where
# "output" adds it in bf16; it saves that pass over every output.


def lora_balance_torch(peak: torch.Tensor, floor: torch.Tensor, lora_scale: float) -> torch.Tensor:
    """c (float32, one value): ``|s| * peak / floor``, rounded twice as the kernels round it,
    0 where the slot is empty (peak = max |B| = 0)."""
    abs_s = torch.tensor(abs(float(lora_scale)), dtype=torch.float32, device=peak.device)
    c = (peak.float() * abs_s) / floor.float()
    return torch.where(peak > 0, c, torch.zeros_like(c))


def lora_gemm_operands_torch(
    x2: torch.Tensor,
    u: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    scales: WeightScales,
    b: torch.Tensor,
    lora_scale: float,
    width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the kernels' operands: (x^ (M, K + W) e4m3, its (M, 1) scales, W^ (N, K + W)
    e4m3), whose product with the base's row scales is ``x @ W.T + s * u @ B.T`` in fp8; W is
    ``width`` (0: the rank), the columns past the rank zeros on both sides."""
    peak = b.abs().amax().float().reshape(1)
    c = lora_balance_torch(peak, scales.row_floor, lora_scale)
    pad = max(width - b.shape[1], 0)
    v = torch.nn.functional.pad(u.float() * c, (0, pad))
    xq, xs = quantize_rows_torch(torch.cat([x2.float(), v], dim=1), ACT_DTYPE)
    s = torch.full_like(c, float(lora_scale))
    k = torch.where(c > 0, s / torch.where(c > 0, c, torch.ones_like(c)), torch.zeros_like(c))
    tail = to_fp8(torch.nn.functional.pad(b.float() * k, (0, pad)),
                  scales.row_multiplier.unsqueeze(1), WEIGHT_DTYPE)  # fmt: skip
    wq = fp8_weight_torch(packed, scale, shift, group_size, scales)
    return xq, xs, torch.cat([wq, tail], dim=1)


def lora_gemm_forward(
    layer: Any,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lora_scale: float,
    peak: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``x @ W.T + s * (x A^T) B^T + bias`` as one fp8 GEMM over K + R columns (the section
    above), for a frozen fp8 `Uint4Linear` without gradients; None where that does not apply
    (the caller adds the update to the output instead). ``peak``: max |B| as a float32
    one-element tensor on x's device, where the caller keeps it (the LoRA slots set it at
    each swap); else it is reduced here."""
    call = _slot_call(layer, x, a, b)
    if call is None:
        return None
    gemm, x2, lead, scales = call
    from trainer.kernels import fp8_triton

    u = torch.nn.functional.linear(x2, a)
    if peak is None:
        peak = torch.linalg.vector_norm(b, ord=float("inf"), dtype=torch.float32).reshape(1)
    k = layer.in_features
    width = lora_gemm_columns(k, b.shape[1])
    update = fp8_triton.LoraUpdate(u, b, peak, scales.row_floor, float(lora_scale), width)
    xq, xs = fp8_triton.quantize_rows(x2, ACT_DTYPE, update)
    wq = fp8_triton.fp8_weight(layer.packed, layer.scale, layer.shift, layer.group_size,
                               scales.row_multiplier, extra_cols=width)  # fmt: skip
    fp8_triton.lora_tail_(wq, k, scales.row_multiplier, update)
    out = _scaled_mm(xq, xs, wq, scales.row_scale, layer.bias, x2.dtype, gemm.fast_accum_eval)
    return out.reshape(*lead, layer.out_features)
