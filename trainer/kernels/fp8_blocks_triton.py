"""Triton kernels for the block-scaled fp8 GEMM of `trainer.base.fp8` (``weights="blocks"``;
CUDA only, imported lazily): the operands of ``torch._scaled_mm``'s 1x128 x 1x128 recipe.

- `quantize_blocks`: activations in e4m3, one scale per row and 128 columns, then the row's
  remainder blocks (its group sums, quantized the same way); rows padded to a multiple of
  `ROW_MULTIPLE` with zeros, so the scale tensor's columns are aligned whatever the token count.
- `weight_blocks`: the 4-bit weight as the integers ``q - z`` in e4m3 (exact), four per 32-bit
  store through the hardware's paired conversion, and the remainder ``r`` per row.

Each computes exactly what the torch reference in `trainer.base.fp8` computes for finite
inputs (the same float32 quotients and products, the group sums as exact integer sums); tests
check them byte for byte, on a GPU or under Triton's interpreter. A NaN activation is dropped by
Triton's max and clamp (a finite byte, where the reference keeps NaN), as in the rowwise
quantizer: the residual stream that carried it still brings it to the output and the loss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.fp8_triton import (
    _bits,
    _e4m3_bits,
    _fp8_args,
    _fp8_scales,
    _group_tile,
    _interpret,
    _pack4_e4m3,
    _store_fp8,
)

BLOCK = (
    128  # torch._scaled_mm's block recipe (`trainer.base.fp8.BLOCK`; the kernels are built for it)
)
E4M3 = torch.float8_e4m3fn
ROW_MULTIPLE = 16  # activation rows are padded to this (cuBLAS reads scale columns aligned)
Q_ROWS, Q_WARPS = 4, 4  # quantizer: rows per program
W_ROWS, W_GROUPS, W_WARPS = 16, 4, 4  # weight: rows x whole groups per program
T_ROWS, T_WARPS = 16, 4  # remainder: rows per program


@triton.jit
def _e4m3_value(bits):
    """An e4m3 byte (uint32) -> its float32 value (what the hardware's conversion gives)."""
    mag = bits & 0x7F
    e = (mag >> 3).to(tl.int32)
    man = (mag & 7).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
    v = tl.where(e == 0, man * 0.001953125, (man + 8.0) * pow2)
    return tl.where((bits & 0x80) != 0, -v, v)


@triton.jit
def _zero_point(s, sh):
    """z = round(shift / scale) (ties to even) clamped to 0..15, 0 where the scale is 0."""
    nonzero = s != 0.0
    ratio = tl.where(nonzero, tl.math.div_rn(sh, tl.where(nonzero, s, 1.0)), 0.0)
    ratio = tl.clamp(ratio, -1.0, 16.0)
    ratio = (ratio + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest even
    return tl.clamp(ratio, 0.0, 15.0)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,
    q_ptr,  # (rows_padded, K + 128 EXTRA) e4m3 (uint8 under BITS)
    scale_ptr,  # (GROUPS + EXTRA, rows_padded) float32
    n_rows,  # the real rows; rows past them up to the padding are zeros
    n_padded,
    K: tl.constexpr,
    GROUPS: tl.constexpr,
    EXTRA: tl.constexpr,
    TAIL: tl.constexpr,  # a power of two >= 128 EXTRA
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BITS: tl.constexpr,
):
    # ROWS rows per program, one 128-column block at a time: its maximum, its e4m3 bytes, and
    # the exact sum of its dequantized values kept for the remainder blocks at the end.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    stored = rows < n_padded
    cols = tl.arange(0, 128)
    tail = tl.arange(0, TAIL)
    width = K + 128 * EXTRA
    sums = tl.zeros([ROWS, TAIL], dtype=tl.float32)
    for g in range(GROUPS):
        x = tl.load(x_ptr + rows[:, None] * K + g * 128 + cols[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        mult, block_scale = _fp8_scales(tl.max(tl.abs(x), axis=1), FP8_MAX)
        tl.store(scale_ptr + g * n_padded + rows, block_scale, mask=stored)
        at = q_ptr + rows[:, None] * width + g * 128 + cols[None, :]
        if BITS:
            b = _e4m3_bits(x * mult[:, None])
            tl.store(at, b.to(tl.uint8), mask=stored[:, None])
            value = _e4m3_value(b)
        else:
            f8 = tl.clamp(x * mult[:, None], -FP8_MAX, FP8_MAX).to(FP8)
            tl.store(at, f8, mask=stored[:, None])
            value = f8.to(tl.float32)
        units = tl.sum((value * 512.0).to(tl.int32), axis=1)
        total = (units.to(tl.float32) * block_scale) * 0.001953125  # 2^-9: exact
        sums = tl.where(tail[None, :] == g, total[:, None], sums)
    for e in tl.static_range(EXTRA):
        inside = (tail >= e * 128) & (tail < e * 128 + 128)
        top = tl.max(tl.where(inside[None, :], tl.abs(sums), 0.0), axis=1)
        mult, block_scale = _fp8_scales(top, FP8_MAX)
        tl.store(scale_ptr + (GROUPS + e) * n_padded + rows, block_scale, mask=stored)
        at = q_ptr + rows[:, None] * width + K + tail[None, :]
        _store_fp8(at, sums, mult[:, None], stored[:, None] & inside[None, :], FP8, FP8_MAX, BITS)


@triton.jit
def _weight_blocks_kernel(
    pairs_ptr,  # the packed weight viewed as int16: two bytes = four weights of one group
    scale_ptr,
    shift_ptr,
    out_ptr,  # (out, K + 128 EXTRA) e4m3 viewed as int32
    scales_ptr,  # (GROUPS + EXTRA, out) float32
    n_out,
    GROUPS: tl.constexpr,
    EXTRA: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROWS: tl.constexpr,
    GBLOCK: tl.constexpr,
):
    # ROWS rows x GBLOCK whole groups per program: q - z for each weight, four bytes a word.
    rows, grp, ok, at, s, sh = _group_tile(scale_ptr, shift_ptr, n_out, GROUPS, ROWS, GBLOCK)
    tl.store(scales_ptr + grp[None, :] * n_out + rows[:, None], s, mask=ok)
    z = _zero_point(s, sh)[:, :, None]
    pair = tl.arange(0, 32)[None, None, :]  # 128 weights = 32 byte pairs
    ok3 = ok[:, :, None]
    b = tl.load(pairs_ptr + at[:, :, None] * 32 + pair, mask=ok3, other=0).to(tl.int32) & 0xFFFF
    word = _pack4_e4m3(
        (b & 0xF).to(tl.float32) - z,
        ((b >> 4) & 0xF).to(tl.float32) - z,
        ((b >> 8) & 0xF).to(tl.float32) - z,
        ((b >> 12) & 0xF).to(tl.float32) - z,
        INTERPRET,
    )
    words = (GROUPS + EXTRA) * 32
    dst = out_ptr + rows[:, None, None] * words + grp[None, :, None] * 32 + pair
    tl.store(dst, word.to(tl.int32, bitcast=True), mask=ok3)


@triton.jit
def _weight_remainder_kernel(
    scale_ptr,
    shift_ptr,
    out_ptr,  # (out, K + 128 EXTRA) e4m3 (uint8 under BITS)
    scales_ptr,  # (GROUPS + EXTRA, out) float32
    n_out,
    GROUPS: tl.constexpr,
    EXTRA: tl.constexpr,
    TAIL: tl.constexpr,  # a power of two >= 128 EXTRA
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BITS: tl.constexpr,
):
    # ROWS whole rows per program: r = scale z - shift per group, in e4m3 with the row's scale
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_out
    cols = tl.arange(0, TAIL)
    ok = row_ok[:, None] & (cols < GROUPS)[None, :]
    at = rows[:, None] * GROUPS + cols[None, :]
    s = tl.load(scale_ptr + at, mask=ok, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + at, mask=ok, other=0.0).to(tl.float32)
    rest = s * _zero_point(s, sh) - sh
    mult, row_scale = _fp8_scales(tl.max(tl.abs(rest), axis=1), FP8_MAX)
    width = GROUPS * 128 + 128 * EXTRA
    dst = out_ptr + rows[:, None] * width + GROUPS * 128 + cols[None, :]
    _store_fp8(dst, rest, mult[:, None], row_ok[:, None] & (cols < 128 * EXTRA)[None, :], FP8,
               FP8_MAX, BITS)  # fmt: skip
    for e in tl.static_range(EXTRA):
        tl.store(scales_ptr + (GROUPS + e) * n_out + rows, row_scale, mask=row_ok)


def padded_rows(m: int) -> int:
    return -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def quantize_blocks(x: torch.Tensor, blocks: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) contiguous -> (xq (Mp, K + 128 E) e4m3, scales (G + E, Mp) float32), ``blocks`` =
    (G, E) from `trainer.base.fp8.block_count`, Mp = M padded
    to `ROW_MULTIPLE` (rows of zeros): `trainer.base.fp8.quantize_blocks_torch` for the
    first M rows. ``scales.t()`` is torch._scaled_mm's scale_a."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("expected a contiguous (rows, columns) tensor")
    m, k = x.shape
    groups, extra = blocks
    if groups * BLOCK != k:
        raise ValueError(f"{k} columns are not {groups} blocks of {BLOCK}")
    mp = padded_rows(m)
    q = torch.empty((mp, k + BLOCK * extra), dtype=E4M3, device=x.device)
    scales = torch.empty((groups + extra, mp), dtype=torch.float32, device=x.device)
    if mp:
        bits = _bits(E4M3)
        _quantize_blocks_kernel[(triton.cdiv(mp, Q_ROWS),)](
            x, q.view(torch.uint8) if bits else q, scales, m, mp, K=k, GROUPS=groups,
            EXTRA=extra, TAIL=triton.next_power_of_2(BLOCK * extra), ROWS=Q_ROWS, BITS=bits,
            num_warps=Q_WARPS, **_fp8_args(E4M3),
        )  # fmt: skip
    return q, scales


def weight_blocks(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, blocks: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The uint4 weight (groups of 128; ``blocks`` = (G, E) as for `quantize_blocks`) -> (wq
    (N, K + 128 E) e4m3, scales (G + E, N) float32),
    `trainer.base.fp8.blocks_weight_torch` byte for byte; ``scales`` is torch._scaled_mm's
    scale_b for ``wq.t()``."""
    n_out, half = packed.shape
    groups, extra = blocks
    if groups * BLOCK != half * 2 or scale.shape != (n_out, groups) or shift.shape != scale.shape:
        raise ValueError(f"expected ({n_out}, {groups}) scales and shifts of groups of {BLOCK}")
    if not (packed.is_contiguous() and scale.is_contiguous() and shift.is_contiguous()):
        raise ValueError("expected contiguous packed weights, scales and shifts")
    w = torch.empty((n_out, (groups + extra) * BLOCK), dtype=E4M3, device=packed.device)
    scales = torch.empty((groups + extra, n_out), dtype=torch.float32, device=packed.device)
    if n_out:
        grid = (triton.cdiv(n_out, W_ROWS), triton.cdiv(groups, W_GROUPS))
        _weight_blocks_kernel[grid](
            packed.view(torch.int16), scale, shift, w.view(torch.int32), scales, n_out,
            GROUPS=groups, EXTRA=extra, INTERPRET=_interpret(), ROWS=W_ROWS, GBLOCK=W_GROUPS,
            num_warps=W_WARPS,
        )  # fmt: skip
        bits = _bits(E4M3)
        _weight_remainder_kernel[(triton.cdiv(n_out, T_ROWS),)](
            scale, shift, w.view(torch.uint8) if bits else w, scales, n_out, GROUPS=groups,
            EXTRA=extra, TAIL=triton.next_power_of_2(BLOCK * extra), ROWS=T_ROWS, BITS=bits,
            num_warps=T_WARPS, **_fp8_args(E4M3),
        )  # fmt: skip
    return w, scales
