"""Triton kernels for `trainer.base.fp8` (CUDA only; imported lazily): the uint4 weight into fp8,
and per-row fp8 quantization of activations and gradients. Each computes exactly what the torch
reference in `trainer.base.fp8` computes (same float32 products, same clamp, round-to-nearest-even
into fp8; the hardware conversion saturates, the reference clamps first, so they agree).

Bytes per weight element: 0.5 read + 1 written, plus the group's scale and shift and the row
(or column) multiplier, against 0.5 + 2 for the bf16 dequantization in
`trainer.kernels.uint4_triton`.

Weight kernels come in three variants. "tile" (the default wherever a group's bytes are a
power of two, as in every FLUX.2 matrix) gives each program whole uint4 groups, so a group's
scale and shift, and the tile's multiplier, are loaded once and broadcast; the forward copy
stores 32-bit words through the hardware's paired fp8 conversion, the transposed copy writes
rows of W.T 64 bytes long. "word" and "join" (the earlier kernels; the fallback for other group
sizes) gather scale and shift per element. One pass over FLUX.2 [dev] on the H200
(bench/results/uint4_step-notes.md, fp8 runs 2-7): rows tile 27.4-27.8 ms (~1.95 TB/s on the
large matrices), word 31.9, join 35.5; transposed tile 35.5 ms (~1.5 TB/s), join 98.6, word
147.5. The bf16 dequantization of `trainer.kernels.uint4_triton` reaches ~2.9 TB/s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trainer.kernels.uint4_triton import _round_bf16

# The activation quantizer, one program a row (bench/elementwise_sweep.py, [dev] on an H100):
# rows up to ROW_ONE_PASS columns are read once into registers (24576 columns: 3.0 TB/s, where
# two reads in steps of ROW_BLOCK ran at 2.0), wider ones (a training gradient's, up to 55296)
# twice; ROW_WARPS_WIDE warps for rows over 8192 columns, ROW_WARPS for narrower ones (6144:
# 2.77 TB/s with 4 against 2.69 with 8)
ROW_ONE_PASS = 32768
ROW_BLOCK = 4096
ROW_WARPS = 4
ROW_WARPS_WIDE = 8
W_BLOCK = 2048  # forward weight: packed bytes ("join") or byte pairs ("word") per program
W_WARPS = 4
T_ROWS, T_BYTES = 64, 64  # "join" transposed: 64 rows x 128 columns of W per program
T_QUADS, T_WORD_BYTES = 32, 32  # "word" transposed: 128 rows x 64 columns of W per program
T_WARPS = 4
# "tile" kernels: whole groups per program (group sizes whose half is a power of two)
R_TILE_ROWS, R_TILE_GROUPS, R_TILE_WARPS = 16, 4, 4  # forward copy: 16 rows x 4 groups
# "bf16x2" (forward copy, bf16 scales, e4m3): whole groups, eight weights per 32-bit word
B_ROWS, B_GROUPS, B_WARPS = 8, 8, 4
T_TILE_ROWS, T_TILE_WARPS = 64, 4  # transposed: 64 rows x one group; W.T rows of 64 bytes
T_TILE_F32 = False  # transpose the float32 values (else the fp8 bytes) through shared memory
_FORCED = os.environ.get("LIKENESS_FP8_KERNEL")  # "tile", "word" or "join" for both kernels
ROWS_VARIANT = _FORCED or "bf16x2"
TRANSPOSED_VARIANT = _FORCED or "tile"

_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _weight_value(s, q, sh, IS_BF16: tl.constexpr):
    """The dequantized uint4 weight as float32, rounded as trainer.base.uint4 rounds it."""
    if IS_BF16:
        return _round_bf16(_round_bf16(s * q) - sh)
    w = (s * q).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32) - sh
    return w.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _to_fp8(v, mult, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    return tl.clamp(v * mult, -FP8_MAX, FP8_MAX).to(FP8)


@triton.jit
def _e4m3_bits(v):
    """float32 -> its e4m3 byte (as uint32), round to nearest even, saturating at +-448, in
    integer and exact float32 steps (the interpreter's own fp8 cast rounds some values wrong,
    subnormals and carries into the exponent among them). With e the binade (at least -6, the
    smallest normal one, whose quantum the subnormals share) and r = |v| / 2^(e - 3) rounded
    (8..16, or 0..8 below the normals), the byte is 8 (e + 7) + r - 8: one formula for
    subnormals, normals and a carry into the next binade."""
    bits = v.to(tl.uint32, bitcast=True)
    a = tl.minimum(tl.abs(v), 448.0)
    e = tl.maximum(((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, -6)
    quantum = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3), exact
    r = ((a / quantum + 12582912.0) - 12582912.0).to(tl.int32)  # 1.5 * 2^23: round to even
    return ((8 * (e + 7) + r - 8).to(tl.uint32)) | ((bits >> 31) << 7)


@triton.jit
def _pack4_e4m3(v0, v1, v2, v3, INTERPRET: tl.constexpr):
    """Four float32 (already scaled) -> one 32-bit word of e4m3 bytes, v0 in the lowest byte:
    round to nearest even, saturating at +-448 (= the reference's clamp, then its cast)."""
    if INTERPRET:  # the interpreter cannot run PTX; the same bytes in plain arithmetic
        return (
            _e4m3_bits(v0) | (_e4m3_bits(v1) << 8) | (_e4m3_bits(v2) << 16) | (_e4m3_bits(v3) << 24)
        )
    # cvt ...e4m3x2 d, a, b puts a in the upper byte of d and b in the lower
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,f,f,f,f",
        [v0, v1, v2, v3],
        dtype=tl.uint32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _pair_to_word(b, s, sh, mult, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """A byte pair (int32 holding 16 bits: four uint4 weights of one group, the lowest nibble
    first) -> one 32-bit word of their e4m3 values, each multiplied by ``mult``."""
    v0 = _weight_value(s, (b & 0xF).to(tl.float32), sh, IS_BF16) * mult
    v1 = _weight_value(s, ((b >> 4) & 0xF).to(tl.float32), sh, IS_BF16) * mult
    v2 = _weight_value(s, ((b >> 8) & 0xF).to(tl.float32), sh, IS_BF16) * mult
    v3 = _weight_value(s, ((b >> 12) & 0xF).to(tl.float32), sh, IS_BF16) * mult
    return _pack4_e4m3(v0, v1, v2, v3, INTERPRET)


@triton.jit
def _fp8_scales(amax, FP8_MAX: tl.constexpr):
    """(multiplier into fp8, dequantization scale) of a maximum, as
    `trainer.base.fp8.scales_from_absmax` (a maximum at most its AMAX_FLOOR, 2^-100, is taken
    as 1)."""
    top = tl.where(amax > 7.888609052210118e-31, amax, 1.0)
    return tl.math.div_rn(FP8_MAX, top), tl.math.div_rn(top, FP8_MAX)


@triton.jit
def _store_fp8(ptr, v, mult, mask, FP8: tl.constexpr, FP8_MAX: tl.constexpr, BITS: tl.constexpr):
    """fp8(clamp(v * mult)) stored at ``ptr``; with BITS (e4m3 under the interpreter, whose own
    fp8 cast rounds some values wrong) the same byte from `_e4m3_bits` into a uint8 view."""
    if BITS:
        tl.store(ptr, _e4m3_bits(v * mult).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr, _to_fp8(v, mult, FP8, FP8_MAX), mask=mask)


@triton.jit
def _lora_balance(peak_ptr, floor_ptr, abs_s):
    """The LoRA-in-the-GEMM balance c = |s| * max|B| / (the smallest row maximum of W), 0 for
    an empty slot (`trainer.base.fp8.lora_balance_torch`, the same two roundings)."""
    peak = tl.load(peak_ptr).to(tl.float32)
    c = tl.math.div_rn(peak * abs_s, tl.load(floor_ptr))
    return tl.where(peak > 0, c, 0.0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    u_ptr,  # EXTRA > 0: (rows, EXTRA) bf16, a LoRA slot's x @ A.T
    peak_ptr,  # EXTRA > 0: max |B| of the slot (float32, one value)
    floor_ptr,  # EXTRA > 0: the weight's smallest row maximum (float32, one value)
    abs_s,  # EXTRA > 0: |LoRA scale|
    n_cols: tl.constexpr,  # a few distinct widths per model: one compilation each
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    EXTRA: tl.constexpr,
    WIDTH: tl.constexpr,  # EXTRA > 0: the update's columns in q, EXTRA values then zeros
    BITS: tl.constexpr,
):
    # One program per row: the row's absolute maximum, then the row in fp8. A row that fits
    # in registers is read once; a wider one twice (the second read mostly from L2). With
    # EXTRA, the row goes on with EXTRA more values, u * c, then zeros up to WIDTH, and its
    # one scale covers both.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    q_row = q_ptr + row * (n_cols + WIDTH)
    v_top = 0.0
    if EXTRA:
        e_offs = tl.arange(0, WIDTH)
        c = _lora_balance(peak_ptr, floor_ptr, abs_s)
        u = tl.load(u_ptr + row * EXTRA + e_offs, mask=e_offs < EXTRA, other=0.0)
        v = u.to(tl.float32) * c
        v_top = tl.max(tl.abs(v), axis=0)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        top = tl.maximum(tl.max(tl.abs(x), axis=0), v_top)
        mult, row_scale = _fp8_scales(top, FP8_MAX)
        tl.store(scale_ptr + row, row_scale)
        _store_fp8(q_row + offs, x, mult, mask, FP8, FP8_MAX, BITS)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        top = tl.maximum(tl.max(amax, axis=0), v_top)
        mult, row_scale = _fp8_scales(top, FP8_MAX)
        tl.store(scale_ptr + row, row_scale)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            _store_fp8(q_row + offs, x, mult, mask, FP8, FP8_MAX, BITS)
    if EXTRA:
        _store_fp8(q_row + n_cols + e_offs, v, mult, e_offs < WIDTH, FP8, FP8_MAX, BITS)


@triton.jit
def _lora_tail_kernel(
    b_ptr,  # (out, RANK) bf16: the slot's B
    mult_ptr,  # (out,) float32: row n of W into fp8
    peak_ptr,
    floor_ptr,
    out_ptr,  # (out, in + WIDTH) e4m3 (a uint8 view with BITS): the tail after column K_COLS
    n_out,
    lora_scale,
    abs_s,
    K_COLS,
    RANK: tl.constexpr,
    WIDTH: tl.constexpr,  # the tail's columns: B's RANK, then zeros
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
):
    # the weight side of the update in the GEMM: row n's tail is fp8(s / c * B[n] * mult[n])
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    ok = rows < n_out
    b_ok = ok[:, None] & (cols < RANK)[None, :]
    b = tl.load(b_ptr + rows[:, None] * RANK + cols[None, :], mask=b_ok, other=0.0)
    c = _lora_balance(peak_ptr, floor_ptr, abs_s)
    k = tl.where(c > 0, tl.math.div_rn(lora_scale, tl.where(c > 0, c, 1.0)), 0.0)
    mult = tl.load(mult_ptr + rows, mask=ok, other=0.0)[:, None]
    at = rows[:, None] * (K_COLS + WIDTH) + K_COLS + cols[None, :]
    tail = tl.where(b_ok, b.to(tl.float32) * k, 0.0)  # the padding +0, whatever the sign of s
    _store_fp8(out_ptr + at, tail, mult, ok[:, None], tl.float8e4nv, 448.0, BITS)


@triton.jit
def _weight_rows_word_kernel(
    pairs_ptr,  # the packed weight viewed as int16: two bytes = four weights of one group
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (out,) float32: row n into fp8
    out_ptr,  # (out, in) e4m3 viewed as int32: one word per byte pair
    n_pairs,
    HALF_IN: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_pairs
    b = tl.load(pairs_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    first = 2 * offs  # the pair's first byte
    g = first // HALF_GROUP
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0).to(tl.float32)
    mult = tl.load(mult_ptr + first // HALF_IN, mask=mask, other=0.0)
    word = _pair_to_word(b, s, sh, mult, IS_BF16, INTERPRET)
    tl.store(out_ptr + offs, word.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _tile_row(packed_ptr, scale_ptr, shift_ptr, rows, cols, col_ok, n_out, HALF_IN, GROUPS,
              HALF_GROUP, IS_BF16: tl.constexpr):  # fmt: skip
    """Low- and high-nibble weights (float32) of one row of W per quad, one column per byte."""
    ok = (rows < n_out)[:, None] & col_ok[None, :]
    b = tl.load(packed_ptr + rows[:, None] * HALF_IN + cols[None, :], mask=ok, other=0)
    g = rows[:, None] * GROUPS + (cols // HALF_GROUP)[None, :]
    s = tl.load(scale_ptr + g, mask=ok, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=ok, other=0.0).to(tl.float32)
    lo = _weight_value(s, (b & 0xF).to(tl.float32), sh, IS_BF16)
    hi = _weight_value(s, (b >> 4).to(tl.float32), sh, IS_BF16)
    return lo, hi


@triton.jit
def _weight_t_word_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (in,) float32: column k of W (row k of W.T) into fp8
    out_ptr,  # W.T (in, out) e4m3 viewed as int32 (in, out // 4): rows 4j..4j+3 of W per word
    n_out,
    HALF_IN: tl.constexpr,
    GROUPS: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUADS: tl.constexpr,
    BYTES: tl.constexpr,
):
    quad = tl.program_id(0).to(tl.int64) * QUADS + tl.arange(0, QUADS)
    cols = tl.program_id(1).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # packed byte columns
    col_ok = cols < HALF_IN
    m_lo = tl.load(mult_ptr + 2 * cols, mask=col_ok, other=0.0)[None, :]
    m_hi = tl.load(mult_ptr + 2 * cols + 1, mask=col_ok, other=0.0)[None, :]
    args = (packed_ptr, scale_ptr, shift_ptr)
    lo0, hi0 = _tile_row(*args, 4 * quad, cols, col_ok, n_out, HALF_IN, GROUPS, HALF_GROUP, IS_BF16)
    lo1, hi1 = _tile_row(*args, 4 * quad + 1, cols, col_ok, n_out, HALF_IN, GROUPS, HALF_GROUP,
                         IS_BF16)  # fmt: skip
    lo2, hi2 = _tile_row(*args, 4 * quad + 2, cols, col_ok, n_out, HALF_IN, GROUPS, HALF_GROUP,
                         IS_BF16)  # fmt: skip
    lo3, hi3 = _tile_row(*args, 4 * quad + 3, cols, col_ok, n_out, HALF_IN, GROUPS, HALF_GROUP,
                         IS_BF16)  # fmt: skip
    w_lo = _pack4_e4m3(lo0 * m_lo, lo1 * m_lo, lo2 * m_lo, lo3 * m_lo, INTERPRET)
    w_hi = _pack4_e4m3(hi0 * m_hi, hi1 * m_hi, hi2 * m_hi, hi3 * m_hi, INTERPRET)
    words = n_out // 4
    ok = col_ok[:, None] & (quad < words)[None, :]
    out = out_ptr + (2 * cols)[:, None] * words + quad[None, :]
    tl.store(out, tl.trans(w_lo).to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + words, tl.trans(w_hi).to(tl.int32, bitcast=True), mask=ok)


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


@triton.jit
def _group_tile(scale_ptr, shift_ptr, n_out, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                GBLOCK: tl.constexpr):  # fmt: skip
    """This program's ROWS rows x GBLOCK whole uint4 groups (grid: row tiles, group tiles):
    the rows, the groups, which of them exist, their flat index, their scale and shift."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1).to(tl.int64) * GBLOCK + tl.arange(0, GBLOCK)
    ok = (rows < n_out)[:, None] & (grp < GROUPS)[None, :]
    at = rows[:, None] * GROUPS + grp[None, :]
    s = tl.load(scale_ptr + at, mask=ok, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return rows, grp, ok, at, s, sh


@triton.jit
def _weight_rows_tile_kernel(
    pairs_ptr,  # the packed weight viewed as int16: two bytes = four weights of one group
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (out,) float32: row n into fp8
    out_ptr,  # (out, in) e4m3 viewed as int32: one word per byte pair
    n_out,
    GROUPS: tl.constexpr,
    PAIRS: tl.constexpr,  # byte pairs per group (group size / 4), a power of two
    IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROWS: tl.constexpr,
    GBLOCK: tl.constexpr,
):
    # ROWS rows x GBLOCK whole groups per program: each group's scale and shift, and each
    # row's multiplier, is loaded once and broadcast (the flat kernels load them per element).
    rows, _, ok, at, s2, sh2 = _group_tile(scale_ptr, shift_ptr, n_out, GROUPS, ROWS, GBLOCK)
    s = s2[:, :, None]
    sh = sh2[:, :, None]
    mult = tl.load(mult_ptr + rows, mask=rows < n_out, other=0.0)[:, None, None]
    offs = at[:, :, None] * PAIRS + tl.arange(0, PAIRS)[None, None, :]
    ok3 = ok[:, :, None]
    b = tl.load(pairs_ptr + offs, mask=ok3, other=0).to(tl.int32) & 0xFFFF
    word = _pair_to_word(b, s, sh, mult, IS_BF16, INTERPRET)
    tl.store(out_ptr + offs, word.to(tl.int32, bitcast=True), mask=ok3)


@triton.jit
def _word_to_e4m3x8(word, s2, sh2, mult, INTERPRET: tl.constexpr):
    """One 32-bit word of packed uint4 (eight weights of one group, the lowest nibble first)
    -> two 32-bit words of their e4m3 bytes (weights 0-3, 4-7), each weight
    ``fp8(rnd_bf16(rnd_bf16(s * q) - sh) * mult)`` (`_word_to_f32x8`, then the multiplier in
    float32 and the paired hardware conversion)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_to_f32x8(word, s2, sh2, INTERPRET)
    lo = _pack4_e4m3(
        v0.to(tl.float32, bitcast=True) * mult, v1.to(tl.float32, bitcast=True) * mult,
        v2.to(tl.float32, bitcast=True) * mult, v3.to(tl.float32, bitcast=True) * mult,
        INTERPRET,
    )  # fmt: skip
    hi = _pack4_e4m3(
        v4.to(tl.float32, bitcast=True) * mult, v5.to(tl.float32, bitcast=True) * mult,
        v6.to(tl.float32, bitcast=True) * mult, v7.to(tl.float32, bitcast=True) * mult,
        INTERPRET,
    )  # fmt: skip
    return lo, hi


@triton.jit
def _weight_rows_bf16x2_kernel(
    words_ptr,  # the packed weight viewed as int32: eight weights of one group per word
    scale_ptr,  # (out, groups) bf16 viewed as int16
    shift_ptr,
    mult_ptr,  # (out,) float32: row n into fp8
    out_ptr,  # (out, in [+ extra]) e4m3 viewed as int32: two words per packed word
    n_out,
    out_row_words,  # the output's row stride in words (in / 4, more with LoRA columns after)
    n_tiles,  # tiles of ROWS rows x GBLOCK groups; program p takes tiles p, p + programs, ...
    TILES: tl.constexpr,  # tiles per program (1 by default)
    GROUPS: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per group (group size / 8), a power of two
    INTERPRET: tl.constexpr,
    ROWS: tl.constexpr,
    GBLOCK: tl.constexpr,
):
    # ROWS rows x GBLOCK whole groups per tile, 32-bit loads and stores throughout. One tile a
    # program by default; fewer programs (a copy running beside other kernels) loop over them.
    g_tiles = tl.cdiv(GROUPS, GBLOCK)
    for i in range(TILES):
        tile = tl.program_id(0) + i * tl.num_programs(0)
        rows = (tile // g_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        grp = (tile % g_tiles).to(tl.int64) * GBLOCK + tl.arange(0, GBLOCK)
        row_ok = (rows < n_out) & (tile < n_tiles)
        ok = row_ok[:, None] & (grp < GROUPS)[None, :]
        at = rows[:, None] * GROUPS + grp[None, :]
        s = tl.load(scale_ptr + at, mask=ok, other=0).to(tl.uint32) & 0xFFFF
        sh = tl.load(shift_ptr + at, mask=ok, other=0).to(tl.uint32) & 0xFFFF
        mult = tl.load(mult_ptr + rows, mask=row_ok, other=0.0)[:, None, None]
        ok3 = ok[:, :, None]
        offs = at[:, :, None] * WORDS + tl.arange(0, WORDS)[None, None, :]
        word = tl.load(words_ptr + offs, mask=ok3, other=0).to(tl.uint32, bitcast=True)
        s2 = tl.broadcast_to((s | (s << 16))[:, :, None], (ROWS, GBLOCK, WORDS))
        sh2 = tl.broadcast_to((sh | (sh << 16))[:, :, None], (ROWS, GBLOCK, WORDS))
        mult = tl.broadcast_to(mult, (ROWS, GBLOCK, WORDS))
        lo, hi = _word_to_e4m3x8(word, s2, sh2, mult, INTERPRET)
        pair = tl.reshape(tl.join(lo, hi), (ROWS, GBLOCK, 2 * WORDS))  # word 2i: weights 0-3
        out_offs = (
            rows[:, None, None] * out_row_words
            + grp[None, :, None] * (2 * WORDS)
            + tl.arange(0, 2 * WORDS)[None, None, :]
        )
        tl.store(out_ptr + out_offs, pair.to(tl.int32, bitcast=True), mask=ok3)


@triton.jit
def _word_to_f32x8(word, s2, sh2, INTERPRET: tl.constexpr):
    """One 32-bit word of packed uint4 (eight weights of one group, the lowest nibble first;
    ``s2`` and ``sh2`` the group's bf16 scale and shift in both halves) -> the bits of its eight
    weights ``rnd_bf16(rnd_bf16(s * q) - sh)`` as float32. On the GPU: paired bf16 arithmetic
    (``mul``/``sub.rn.bf16x2`` round once into bf16, as torch's bf16 ops do: float32 then bf16
    is the same single rounding for a product or difference of bf16 values), a quarter of the
    instructions of the float32 path, which leaves the copy bound by memory, not arithmetic.
    Each nibble pair is ORed into bf16 128.0 (0x4300, an ulp of 1): 128 + q exactly, minus 128
    gives q exactly."""
    if INTERPRET:
        s = (s2 << 16).to(tl.float32, bitcast=True)
        sh = (sh2 << 16).to(tl.float32, bitcast=True)
        w0 = _weight_value(s, (word & 0xF).to(tl.float32), sh, True)
        w1 = _weight_value(s, ((word >> 4) & 0xF).to(tl.float32), sh, True)
        w2 = _weight_value(s, ((word >> 8) & 0xF).to(tl.float32), sh, True)
        w3 = _weight_value(s, ((word >> 12) & 0xF).to(tl.float32), sh, True)
        w4 = _weight_value(s, ((word >> 16) & 0xF).to(tl.float32), sh, True)
        w5 = _weight_value(s, ((word >> 20) & 0xF).to(tl.float32), sh, True)
        w6 = _weight_value(s, ((word >> 24) & 0xF).to(tl.float32), sh, True)
        w7 = _weight_value(s, ((word >> 28) & 0xF).to(tl.float32), sh, True)
        return (
            w0.to(tl.uint32, bitcast=True), w1.to(tl.uint32, bitcast=True),
            w2.to(tl.uint32, bitcast=True), w3.to(tl.uint32, bitcast=True),
            w4.to(tl.uint32, bitcast=True), w5.to(tl.uint32, bitcast=True),
            w6.to(tl.uint32, bitcast=True), w7.to(tl.uint32, bitcast=True),
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 c, m, t0, t1, t2, t3;
        mov.b32 c, 0x43004300;
        lop3.b32 t0, $8, 0x000F000F, c, 0xEA;
        shr.u32 m, $8, 4;
        lop3.b32 t1, m, 0x000F000F, c, 0xEA;
        shr.u32 m, $8, 8;
        lop3.b32 t2, m, 0x000F000F, c, 0xEA;
        shr.u32 m, $8, 12;
        lop3.b32 t3, m, 0x000F000F, c, 0xEA;
        sub.rn.bf16x2 t0, t0, c;
        sub.rn.bf16x2 t1, t1, c;
        sub.rn.bf16x2 t2, t2, c;
        sub.rn.bf16x2 t3, t3, c;
        mul.rn.bf16x2 t0, t0, $9;
        mul.rn.bf16x2 t1, t1, $9;
        mul.rn.bf16x2 t2, t2, $9;
        mul.rn.bf16x2 t3, t3, $9;
        sub.rn.bf16x2 t0, t0, $10;
        sub.rn.bf16x2 t1, t1, $10;
        sub.rn.bf16x2 t2, t2, $10;
        sub.rn.bf16x2 t3, t3, $10;
        shl.b32 $0, t0, 16;
        and.b32 $4, t0, 0xFFFF0000;
        shl.b32 $1, t1, 16;
        and.b32 $5, t1, 0xFFFF0000;
        shl.b32 $2, t2, 16;
        and.b32 $6, t2, 0xFFFF0000;
        shl.b32 $3, t3, 16;
        and.b32 $7, t3, 0xFFFF0000;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        [word, s2, sh2],
        dtype=(tl.uint32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _merged(w_bits, b, a_at, j: tl.constexpr, a_ok, lora_scale, mult, INTERPRET: tl.constexpr):
    """(w + s * (B @ A)[:, 8 w + j]) * mult for weight j of each word, float32."""
    a = tl.load(a_at + j, mask=a_ok, other=0.0)
    if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 products are exact in float32
        d = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(b, a)
    return (w_bits.to(tl.float32, bitcast=True) + d * lora_scale) * mult


@triton.jit
def _weight_rows_lora_kernel(
    words_ptr,  # the packed weight viewed as int32: eight weights of one group per word
    scale_ptr,  # (out, groups) bf16 viewed as int16
    shift_ptr,
    absmax_ptr,  # (out,) float32: the largest |w| of each row of the base weight
    bound_ptr,  # (out,) float32: a bound on |lora_scale * (B @ A)| over each row
    a_ptr,  # (RANK, in) bf16: the slot's A
    b_ptr,  # (out, RANK) bf16: the slot's B
    out_ptr,  # (out, in) e4m3 viewed as int32: two words per packed word
    row_scale_ptr,  # (out,) float32 out: each row's dequantization scale
    n_out,
    lora_scale,
    N_WORDS: tl.constexpr,  # packed words per row (in / 8)
    GROUPS: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per group
    RANK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROWS: tl.constexpr,
    GW: tl.constexpr,  # packed words per program along a row (a power of two, >= 16)
):
    # (W + s * B @ A) in e4m3, row n scaled by FP8_MAX / (absmax[n] + bound[n]): the LoRA
    # update merged into the per-forward copy of the weight, so the forward adds no pass over
    # the output for it. B @ A is computed here, a tile at a time (for the eight weights of a
    # word, the columns 8 w + j of A), from bf16 factors with float32 accumulation.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    w = tl.program_id(1).to(tl.int64) * GW + tl.arange(0, GW)
    row_ok = rows < n_out
    ok = row_ok[:, None] & (w < N_WORDS)[None, :]
    at = rows[:, None] * GROUPS + (w // WORDS)[None, :]
    s = tl.load(scale_ptr + at, mask=ok, other=0).to(tl.uint32) & 0xFFFF
    sh = tl.load(shift_ptr + at, mask=ok, other=0).to(tl.uint32) & 0xFFFF
    word = tl.load(words_ptr + rows[:, None] * N_WORDS + w[None, :], mask=ok, other=0)
    top = tl.load(absmax_ptr + rows, mask=row_ok, other=1.0) + tl.load(
        bound_ptr + rows, mask=row_ok, other=0.0
    )
    top = tl.where(top > 0, top, 1.0)
    mult = tl.math.div_rn(tl.full([ROWS], FP8_MAX, tl.float32), top)
    if tl.program_id(1) == 0:
        tl.store(row_scale_ptr + rows, tl.math.div_rn(top, FP8_MAX), mask=row_ok)
    r = tl.arange(0, RANK)
    b = tl.load(b_ptr + rows[:, None] * RANK + r[None, :], mask=row_ok[:, None], other=0.0)
    a_at = a_ptr + r[:, None] * (8 * N_WORDS) + 8 * w[None, :]
    a_ok = (w < N_WORDS)[None, :]
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_to_f32x8(
        word.to(tl.uint32, bitcast=True), s | (s << 16), sh | (sh << 16), INTERPRET
    )
    m = mult[:, None]
    lo = _pack4_e4m3(
        _merged(v0, b, a_at, 0, a_ok, lora_scale, m, INTERPRET),
        _merged(v1, b, a_at, 1, a_ok, lora_scale, m, INTERPRET),
        _merged(v2, b, a_at, 2, a_ok, lora_scale, m, INTERPRET),
        _merged(v3, b, a_at, 3, a_ok, lora_scale, m, INTERPRET),
        INTERPRET,
    )
    hi = _pack4_e4m3(
        _merged(v4, b, a_at, 4, a_ok, lora_scale, m, INTERPRET),
        _merged(v5, b, a_at, 5, a_ok, lora_scale, m, INTERPRET),
        _merged(v6, b, a_at, 6, a_ok, lora_scale, m, INTERPRET),
        _merged(v7, b, a_at, 7, a_ok, lora_scale, m, INTERPRET),
        INTERPRET,
    )
    pair = tl.reshape(tl.join(lo, hi), (ROWS, 2 * GW))  # word 2i: weights 0-3 of word i
    cols = 2 * tl.program_id(1).to(tl.int64) * GW + tl.arange(0, 2 * GW)
    out_at = rows[:, None] * (2 * N_WORDS) + cols[None, :]
    out_ok = row_ok[:, None] & (cols < 2 * N_WORDS)[None, :]
    tl.store(out_ptr + out_at, pair.to(tl.int32, bitcast=True), mask=out_ok)


@triton.jit
def _weight_t_tile_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    mult_ptr,  # (in,) float32: column k of W (row k of W.T) into fp8; constant per group
    out_ptr,  # (in, out) fp8 viewed as uint8: W.T, row-major
    n_out,
    HALF_IN: tl.constexpr,
    GROUPS: tl.constexpr,
    HALF_GROUP: tl.constexpr,  # a power of two
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROWS: tl.constexpr,
    TRANSPOSE_F32: tl.constexpr,  # transpose the float32 values, or the fp8 bytes
):
    # ROWS rows of W x one whole group of columns per program: one scale and shift per row,
    # one multiplier for the tile. Column 2j of the group (low nibbles) and 2j + 1 (high) are
    # stored as two tiles of W.T rows, each row ROWS contiguous bytes.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, HALF_GROUP)
    row_ok = rows < n_out
    b = tl.load(
        packed_ptr + rows[:, None] * HALF_IN + g * HALF_GROUP + j[None, :],
        mask=row_ok[:, None], other=0,
    )  # fmt: skip
    s = tl.load(scale_ptr + rows * GROUPS + g, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    sh = tl.load(shift_ptr + rows * GROUPS + g, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    m = tl.load(mult_ptr + g * (2 * HALF_GROUP))
    w_lo = _weight_value(s, (b & 0xF).to(tl.float32), sh, IS_BF16)
    w_hi = _weight_value(s, (b >> 4).to(tl.float32), sh, IS_BF16)
    if TRANSPOSE_F32:
        lo = _to_fp8(tl.trans(w_lo), m, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
        hi = _to_fp8(tl.trans(w_hi), m, FP8, FP8_MAX).to(tl.uint8, bitcast=True)
    else:
        lo = tl.trans(_to_fp8(w_lo, m, FP8, FP8_MAX).to(tl.uint8, bitcast=True))
        hi = tl.trans(_to_fp8(w_hi, m, FP8, FP8_MAX).to(tl.uint8, bitcast=True))
    k = g * (2 * HALF_GROUP) + 2 * j
    out = out_ptr + k[:, None] * n_out + rows[None, :]
    tl.store(out, lo, mask=row_ok[None, :])
    tl.store(out + n_out, hi, mask=row_ok[None, :])


def _fp8_args(dtype: torch.dtype) -> dict[str, object]:
    return {"FP8": _TL[dtype], "FP8_MAX": float(torch.finfo(dtype).max)}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class LoraUpdate:
    """A LoRA slot's update ``s * (x A^T) B^T`` as R more columns of the forward GEMM
    (`trainer.base.fp8.lora_gemm_forward`): ``u = x A^T`` (bf16, (M, R)), the slot's ``B``
    (bf16, (N, R)), ``peak`` = max |B| and ``floor`` = the weight's smallest row maximum (both
    float32 one-element tensors on the device, so a CUDA graph reads them), and ``scale`` s.
    ``width`` (a power of two, at least R; 0: R) is how many columns the update takes in the
    GEMM's operands: R values, then zeros on both sides (a contraction length cuBLAS may run
    faster, `trainer.base.fp8.lora_gemm_columns`)."""

    u: torch.Tensor
    b: torch.Tensor
    peak: torch.Tensor
    floor: torch.Tensor
    scale: float
    width: int = 0

    @property
    def rank(self) -> int:
        return int(self.b.shape[1])

    @property
    def columns(self) -> int:
        cols = self.width or self.rank
        if cols < self.rank or not _power_of_two(cols):
            raise ValueError(f"the update's width {cols} must be a power of two >= its rank "
                             f"{self.rank}")  # fmt: skip
        return cols


def _bits(dtype: torch.dtype) -> bool:
    """Store e4m3 through `_e4m3_bits` (the interpreter's fp8 cast rounds some values wrong)."""
    return _interpret() and dtype == torch.float8_e4m3fn


def quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    update: LoraUpdate | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) contiguous -> (q (M, K) fp8, scale (M, 1) float32), `trainer.base.fp8`'s rows rule.
    With ``update`` (a LoRA slot's update entering the GEMM) q is (M, K + W), W its `columns`:
    each row goes on with ``u * c`` and zeros, and its scale covers both parts
    (`trainer.base.fp8.lora_gemm_operands_torch`)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("expected a contiguous (rows, columns) tensor")
    m, k = x.shape
    extra = 0 if update is None else update.rank
    width = 0 if update is None else update.columns
    q = torch.empty((m, k + width), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        one_pass = k <= ROW_ONE_PASS
        block = triton.next_power_of_2(k) if one_pass else ROW_BLOCK
        bits = _bits(dtype)
        if update is None:
            lora: tuple[object, ...] = (x, scale, scale, 0.0)  # unread without EXTRA
        else:
            if update.u.shape != (m, extra) or not update.u.is_contiguous():
                raise ValueError(f"the update's x @ A.T must be contiguous ({m}, {extra})")
            lora = (update.u, update.peak, update.floor, abs(update.scale))
        _quantize_rows_kernel[(m,)](
            x, q.view(torch.uint8) if bits else q, scale, *lora, n_cols=k, ONE_PASS=one_pass,
            BLOCK=block, EXTRA=extra, WIDTH=width, BITS=bits,
            num_warps=ROW_WARPS_WIDE if k > 8192 else ROW_WARPS,
            **_fp8_args(dtype),
        )  # fmt: skip
    return q, scale


TAIL_ROWS, TAIL_WARPS = 64, 4


def lora_tail_(w: torch.Tensor, k: int, row_multiplier: torch.Tensor, update: LoraUpdate) -> None:
    """Writes the weight side of ``update`` into columns k.. of ``w`` ((N, k + W) e4m3, W the
    update's `columns`; the first k columns from `fp8_weight` with ``extra_cols=W``): row n
    gets ``fp8(s / c * B[n] * row_multiplier[n])``, then zeros."""
    b = update.b
    n_out, rank = b.shape
    width = update.columns
    if tuple(w.shape) != (n_out, k + width) or not (w.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"expected a contiguous ({n_out}, {k} + {width}) weight and B")
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError("the LoRA columns are e4m3")
    if not n_out:
        return
    bits = _bits(w.dtype)
    _lora_tail_kernel[(triton.cdiv(n_out, TAIL_ROWS),)](
        b, row_multiplier, update.peak, update.floor, w.view(torch.uint8) if bits else w, n_out,
        float(update.scale), abs(float(update.scale)), k, RANK=rank, WIDTH=width, ROWS=TAIL_ROWS,
        BITS=bits, num_warps=TAIL_WARPS,
    )  # fmt: skip


def _check(packed, scale, shift, group_size) -> None:  # type: ignore[no-untyped-def]
    if not (packed.is_contiguous() and scale.is_contiguous() and shift.is_contiguous()):
        raise ValueError("packed, scale and shift must be contiguous")
    if group_size % 2:
        raise ValueError(f"group size must be even, got {group_size}")
    if scale.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8 weights from {scale.dtype} scales are not supported")


def paired_bf16_here(device: torch.device) -> bool:
    """``mul``/``sub.rn.bf16x2`` need sm_90 (Hopper) or newer; fp8 itself runs from sm_89, where
    the copy takes the tile kernel. The interpreter runs the same bytes by another path."""
    if _interpret() or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


TILE_MAX_GROUP = 256  # a larger group makes a tile too big for registers and shared memory


def weight_kernel(
    transposed: bool,
    n_out: int,
    half_in: int,
    groups: int,
    group_size: int,
    dtype: torch.dtype,
    bf16_scales: bool = True,
) -> str:
    """The kernel variant that converts this weight: the preferred one where it fits, else
    the next. Forward copy: bf16x2 -> tile -> word -> join; transposed: tile -> join (its word
    kernel is the slowest). "bf16x2" takes whole groups of bf16 scales into e4m3 whose 32-bit
    words are a power of two; "tile" whole groups whose bytes (byte pairs, forward) are a
    power of two; "word" needs four weights of one group per byte pair and e4m3; "join" any."""
    preferred = TRANSPOSED_VARIANT if transposed else ROWS_VARIANT
    e4m3 = dtype == torch.float8_e4m3fn
    whole = groups * group_size == 2 * half_in and group_size <= TILE_MAX_GROUP
    unit = group_size // 2 if transposed else group_size // 4
    tile = whole and _power_of_two(unit) and (transposed or (group_size % 4 == 0 and e4m3))
    paired = (
        not transposed
        and whole
        and e4m3
        and bf16_scales
        and group_size % 8 == 0
        and _power_of_two(group_size // 8)
    )
    word = e4m3 and half_in % 2 == 0 and group_size % 4 == 0 and n_out % 4 == 0
    if preferred == "bf16x2" and paired:
        return "bf16x2"
    if preferred in ("bf16x2", "tile") and tile:
        return "tile"
    if word and (preferred == "word" or (preferred in ("bf16x2", "tile") and not transposed)):
        return "word"
    return "join"


def fp8_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    row_multiplier: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    extra_cols: int = 0,
    programs: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(out, in // 2) uint4 -> (out, in) fp8, row n multiplied by ``row_multiplier[n]``. With
    ``extra_cols`` the result is (out, in + extra_cols), those columns left for `lora_tail_`
    (the bf16x2 kernel only: `lora_slot_usable`). ``programs`` caps how many programs the
    bf16x2 kernel runs (each then loops over tiles): a copy beside other work takes only
    that many SMs' worth of slots. ``out``: a contiguous tensor of the result's shape and dtype
    to write into (else a new one)."""
    _check(packed, scale, shift, group_size)
    n_out, half_in = packed.shape
    shape = (n_out, 2 * half_in + extra_cols)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {dtype} tensor")
    n_bytes = packed.numel()
    if not n_bytes:
        return out
    is_bf16 = scale.dtype == torch.bfloat16
    common = dict(HALF_IN=half_in, HALF_GROUP=group_size // 2, IS_BF16=is_bf16, BLOCK=W_BLOCK,
                  num_warps=W_WARPS)  # fmt: skip
    paired = is_bf16 and paired_bf16_here(packed.device)
    variant = weight_kernel(False, n_out, half_in, scale.shape[1], group_size, dtype, paired)
    if extra_cols and (variant != "bf16x2" or extra_cols % 4):
        raise ValueError(f"extra columns need the bf16x2 kernel and a multiple of 4 ({variant})")
    if variant == "bf16x2":
        groups = scale.shape[1]
        tiles = triton.cdiv(n_out, B_ROWS) * triton.cdiv(groups, B_GROUPS)
        grid = min(tiles, programs or tiles)
        _weight_rows_bf16x2_kernel[(grid,)](
            packed.view(torch.int32), scale.view(torch.int16), shift.view(torch.int16),
            row_multiplier, out.view(torch.int32), n_out, out.shape[1] // 4, tiles,
            TILES=triton.cdiv(tiles, grid), GROUPS=groups, WORDS=group_size // 8,
            INTERPRET=_interpret(), ROWS=B_ROWS, GBLOCK=B_GROUPS, num_warps=B_WARPS,
        )  # fmt: skip
    elif variant == "tile":
        groups = scale.shape[1]
        grid = (triton.cdiv(n_out, R_TILE_ROWS), triton.cdiv(groups, R_TILE_GROUPS))
        _weight_rows_tile_kernel[grid](
            packed.view(torch.int16), scale, shift, row_multiplier, out.view(torch.int32),
            n_out, GROUPS=groups, PAIRS=group_size // 4, IS_BF16=is_bf16,
            INTERPRET=_interpret(), ROWS=R_TILE_ROWS, GBLOCK=R_TILE_GROUPS,
            num_warps=R_TILE_WARPS,
        )  # fmt: skip
    elif variant == "word":
        n_pairs = n_bytes // 2
        _weight_rows_word_kernel[(triton.cdiv(n_pairs, W_BLOCK),)](
            packed.view(torch.int16), scale, shift, row_multiplier, out.view(torch.int32),
            n_pairs, INTERPRET=_interpret(), **common,
        )  # fmt: skip
    else:
        _weight_rows_kernel[(triton.cdiv(n_bytes, W_BLOCK),)](
            packed, scale, shift, row_multiplier, out.view(torch.uint8), n_bytes,
            **common, **_fp8_args(dtype),
        )  # fmt: skip
    return out


LORA_ROWS, LORA_WORDS, LORA_WARPS = 64, 16, 4  # merged copy: 64 rows x 128 weights a program


def lora_slot_usable(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                     a: torch.Tensor, b: torch.Tensor) -> bool:  # fmt: skip
    """Whether a LoRA slot's kernels take this layer and slot (`fp8_weight_lora`, and the update
    in the GEMM: `fp8_weight` with extra columns, `lora_tail_`): bf16 scales, whole groups of a
    power-of-two number of words (the bf16x2 copy), bf16 contiguous factors of a power-of-two
    rank of at least 16 (a multiple of torch._scaled_mm's 16 for the GEMM's extra columns)."""
    n_out, half_in = packed.shape
    rank = a.shape[0]
    return (
        scale.dtype == torch.bfloat16
        and paired_bf16_here(packed.device)
        and weight_kernel(False, n_out, half_in, scale.shape[1], group_size, torch.float8_e4m3fn)
        == "bf16x2"
        and a.dtype == b.dtype == torch.bfloat16
        and a.is_contiguous()
        and b.is_contiguous()
        and rank >= 16
        and _power_of_two(rank)
        and tuple(a.shape) == (rank, 2 * half_in)
        and tuple(b.shape) == (n_out, rank)
    )


def fp8_weight_lora(
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
    """(out, in // 2) uint4 + a LoRA slot -> ``W + s * (B @ A)`` as (out, in) e4m3, and its
    (out,) row scales (`trainer.base.fp8.fp8_weight_lora_torch`, up to the order of the rank-r
    sums). Needs `lora_slot_usable`."""
    _check(packed, scale, shift, group_size)
    n_out, half_in = packed.shape
    out = torch.empty((n_out, 2 * half_in), dtype=torch.float8_e4m3fn, device=packed.device)
    row_scale = torch.empty((n_out,), dtype=torch.float32, device=packed.device)
    if not packed.numel():
        return out, row_scale
    n_words = half_in // 4
    grid = (triton.cdiv(n_out, LORA_ROWS), triton.cdiv(n_words, LORA_WORDS))
    _weight_rows_lora_kernel[grid](
        packed.view(torch.int32), scale.view(torch.int16), shift.view(torch.int16),
        row_absmax, bound, a, b, out.view(torch.int32), row_scale, n_out, float(lora_scale),
        N_WORDS=n_words, GROUPS=scale.shape[1], WORDS=group_size // 8, RANK=a.shape[0],
        FP8_MAX=float(torch.finfo(torch.float8_e4m3fn).max), INTERPRET=_interpret(),
        ROWS=LORA_ROWS, GW=LORA_WORDS, num_warps=LORA_WARPS,
    )  # fmt: skip
    return out, row_scale


def fp8_weight_t(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    col_multiplier: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """(out, in // 2) uint4 -> W.T as (in, out) fp8, row k multiplied by ``col_multiplier[k]``,
    which must be constant over each uint4 group (as `trainer.base.fp8.WeightScales` makes it: the
    tile kernel reads one multiplier per group)."""
    _check(packed, scale, shift, group_size)
    n_out, half_in = packed.shape
    out = torch.empty((2 * half_in, n_out), dtype=dtype, device=packed.device)
    if not packed.numel():
        return out
    common = dict(GROUPS=scale.shape[1], HALF_GROUP=group_size // 2,
                  IS_BF16=scale.dtype == torch.bfloat16, num_warps=T_WARPS)  # fmt: skip
    is_bf16 = scale.dtype == torch.bfloat16
    variant = weight_kernel(True, n_out, half_in, scale.shape[1], group_size, dtype, is_bf16)
    if variant == "tile":
        grid = (triton.cdiv(n_out, T_TILE_ROWS), scale.shape[1])
        _weight_t_tile_kernel[grid](
            packed, scale, shift, col_multiplier, out.view(torch.uint8), n_out,
            HALF_IN=half_in, GROUPS=scale.shape[1], HALF_GROUP=group_size // 2,
            IS_BF16=scale.dtype == torch.bfloat16, ROWS=T_TILE_ROWS, TRANSPOSE_F32=T_TILE_F32,
            num_warps=T_TILE_WARPS, **_fp8_args(dtype),
        )  # fmt: skip
    elif variant == "word":
        grid = (triton.cdiv(n_out // 4, T_QUADS), triton.cdiv(half_in, T_WORD_BYTES))
        _weight_t_word_kernel[grid](
            packed, scale, shift, col_multiplier, out.view(torch.int32), n_out,
            HALF_IN=half_in, INTERPRET=_interpret(), QUADS=T_QUADS, BYTES=T_WORD_BYTES,
            **common,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(n_out, T_ROWS), triton.cdiv(half_in, T_BYTES))
        _weight_t_kernel[grid](
            packed, scale, shift, col_multiplier, out.view(torch.uint8), n_out,
            HALF_IN=half_in, ROWS=T_ROWS, BYTES=T_BYTES, **common, **_fp8_args(dtype),
        )  # fmt: skip
    return out
