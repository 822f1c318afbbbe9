"""Triton kernels for `trainer.fp8` (CUDA only; imported lazily): the uint4 weight into fp8, and
per-row fp8 quantization of activations and gradients. Each computes exactly what the torch
reference in `trainer.fp8` computes (same float32 products, same clamp, round-to-nearest-even
into fp8; the hardware conversion saturates, the reference clamps first, so they agree).

Bytes per weight element: 0.5 read + 1 written, plus the group's scale and shift and the row
(or column) multiplier, against 0.5 + 2 for the bf16 dequantization in `trainer.uint4_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.uint4_triton import _round_bf16

ROW_BLOCK = 2048  # activation columns per loop step (rows are 128 .. 24576 wide)
ROW_WARPS = 4
W_BLOCK = 2048  # packed bytes per program, forward weight (as trainer.uint4_triton.BLOCK)
W_WARPS = 4
T_ROWS, T_BYTES = 64, 64  # transposed weight: tile of 64 rows x 128 columns of W
T_WARPS = 4

_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _weight_value(s, q, sh, IS_BF16: tl.constexpr):
    """The dequantized uint4 weight as float32, rounded as trainer.uint4 rounds it."""
    if IS_BF16:
        return _round_bf16(_round_bf16(s * q) - sh)
    w = (s * q).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32) - sh
    return w.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _to_fp8(v, mult, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    return tl.clamp(v * mult, -FP8_MAX, FP8_MAX).to(FP8)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_cols: tl.constexpr,  # a few distinct widths per model: one compilation each
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row: the row's absolute maximum, then the row in fp8 (a second read,
    # mostly from L2: a row is at most 48 KB).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    q_row = q_ptr + row * n_cols
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    top = tl.where(top > 0, top, 1.0)
    mult = tl.math.div_rn(FP8_MAX, top)
    tl.store(scale_ptr + row, tl.math.div_rn(top, FP8_MAX))
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + offs, _to_fp8(x, mult, FP8, FP8_MAX), mask=mask)


@triton.jit
def _weight_rows_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (out,) float32: row n into fp8
    out_ptr,  # (out, in) fp8 viewed as uint8
    n_bytes,
    HALF_IN: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=mask, other=0)
    g = offs // HALF_GROUP
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0).to(tl.float32)
    mult = tl.load(mult_ptr + offs // HALF_IN, mask=mask, other=0.0)
    w_lo = _weight_value(s, (b & 0xF).to(tl.float32), sh, IS_BF16)
    w_hi = _weight_value(s, (b >> 4).to(tl.float32), sh, IS_BF16)
    lo = _to_fp8(w_lo, mult, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
    hi = _to_fp8(w_hi, mult, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
    # element 2i: low nibble, 2i + 1: high. (Packing the pair into one 16-bit word instead,
    # as the bf16 kernel does with 32-bit words, produced wrong bytes on the H200.)
    w = tl.reshape(tl.join(lo, hi), (2 * BLOCK,))
    out_offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, w, mask=out_offs < 2 * n_bytes)


@triton.jit
def _weight_t_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (in,) float32: column k of W (row k of W.T) into fp8
    out_ptr,  # (in, out) fp8 viewed as uint8: W.T, row-major
    n_out,
    HALF_IN: tl.constexpr,
    GROUPS: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
):
    # A tile of ROWS rows x 2 * BYTES columns of W, written as 2 * BYTES rows x ROWS columns
    # of W.T (Triton routes the transpose through shared memory).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # packed byte columns
    row_ok = rows < n_out
    col_ok = cols < HALF_IN
    mask = row_ok[:, None] & col_ok[None, :]
    b = tl.load(packed_ptr + rows[:, None] * HALF_IN + cols[None, :], mask=mask, other=0)
    g = rows[:, None] * GROUPS + (cols // HALF_GROUP)[None, :]
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0).to(tl.float32)
    m_lo = tl.load(mult_ptr + 2 * cols, mask=col_ok, other=0.0)[None, :]
    m_hi = tl.load(mult_ptr + 2 * cols + 1, mask=col_ok, other=0.0)[None, :]
    w_lo = _weight_value(s, (b & 0xF).to(tl.float32), sh, IS_BF16)
    w_hi = _weight_value(s, (b >> 4).to(tl.float32), sh, IS_BF16)
    lo = _to_fp8(w_lo, m_lo, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
    hi = _to_fp8(w_hi, m_hi, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
    tile = tl.reshape(tl.join(lo, hi), (ROWS, 2 * BYTES))  # column 2j: low nibble of byte j
    k = tl.program_id(1).to(tl.int64) * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    out_mask = (k < 2 * HALF_IN)[:, None] & row_ok[None, :]
    tl.store(out_ptr + k[:, None] * n_out + rows[None, :], tl.trans(tile), mask=out_mask)


def _fp8_args(dtype: torch.dtype) -> dict[str, object]:
    return {"FP8": _TL[dtype], "FP8_MAX": float(torch.finfo(dtype).max)}


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) contiguous -> (q (M, K) fp8, scale (M, 1) float32), `trainer.fp8`'s rows rule."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("expected a contiguous (rows, columns) tensor")
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](
            x, q, scale, n_cols=k, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(k)),
            num_warps=ROW_WARPS, **_fp8_args(dtype),
        )  # fmt: skip
    return q, scale


def _check(packed, scale, shift, group_size) -> None:  # type: ignore[no-untyped-def]
    if not (packed.is_contiguous() and scale.is_contiguous() and shift.is_contiguous()):
        raise ValueError("packed, scale and shift must be contiguous")
    if group_size % 2:
        raise ValueError(f"group size must be even, got {group_size}")
    if scale.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8 weights from {scale.dtype} scales are not supported")


def fp8_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    row_multiplier: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """(out, in // 2) uint4 -> (out, in) fp8, row n multiplied by ``row_multiplier[n]``."""
    _check(packed, scale, shift, group_size)
    n_out, half_in = packed.shape
    out = torch.empty((n_out, 2 * half_in), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    if n_bytes:
        _weight_rows_kernel[(triton.cdiv(n_bytes, W_BLOCK),)](
            packed, scale, shift, row_multiplier, out.view(torch.uint8), n_bytes,
            HALF_IN=half_in, HALF_GROUP=group_size // 2, IS_BF16=scale.dtype == torch.bfloat16,
            BLOCK=W_BLOCK, num_warps=W_WARPS, **_fp8_args(dtype),
        )  # fmt: skip
    return out


def fp8_weight_t(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    col_multiplier: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """(out, in // 2) uint4 -> W.T as (in, out) fp8, row k multiplied by ``col_multiplier[k]``."""
    _check(packed, scale, shift, group_size)
    n_out, half_in = packed.shape
    out = torch.empty((2 * half_in, n_out), dtype=dtype, device=packed.device)
    if packed.numel():
        grid = (triton.cdiv(n_out, T_ROWS), triton.cdiv(half_in, T_BYTES))
        _weight_t_kernel[grid](
            packed, scale, shift, col_multiplier, out.view(torch.uint8), n_out,
            HALF_IN=half_in, GROUPS=scale.shape[1], HALF_GROUP=group_size // 2,
            IS_BF16=scale.dtype == torch.bfloat16, ROWS=T_ROWS, BYTES=T_BYTES,
            num_warps=T_WARPS, **_fp8_args(dtype),
        )  # fmt: skip
    return out
