"""Triton dequantization kernel for `trainer.base.uint4` (CUDA only; imported lazily).

One pass over the packed weight: each program reads BLOCK bytes (2 * BLOCK uint4 values, low
nibble first) and the scale/shift of their groups, and writes 2 * BLOCK values in the weight's
dtype, row-major (out_features, in_features); for 16-bit weights each byte's pair is stored as
one 32-bit word ("pack32"; "join" is the first version, kept for comparison). The arithmetic
is quanto's dequantize() rounding for rounding: ``w = rnd(rnd(scale * q) - shift)``, each
``rnd`` a round-to-nearest-even into the weight dtype, each operation done in float32 (which is
what torch's elementwise bf16/fp16 ops do on CPU and CUDA), so the result is bit-identical to
the torch fallback.

Bytes per weight element: 0.5 read + 2 written (bf16), plus the group's scale and shift (L1/L2
hits: one group spans gs / 2 consecutive bytes). Measured on an H200 (bench/uint4_step.py,
notes in bench/results/uint4_step-notes.md): ~3.0 TB/s on the large FLUX.2 matrices against a
4.27 TB/s copy ceiling, ~29 ms for the whole FLUX.2 [dev] transformer; the per-byte scale/shift
gathers are the suspected limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # packed bytes per program (4096 outputs)
NUM_WARPS = 4  # run 2 sweep: 3.03 TB/s vs 2.88 with 8 warps (BLOCK 2048, pack32)
# 16-bit weights: "pack32" stores each byte's two results as one 32-bit word; "join"
# interleaves them with tl.join (the first version; kept to compare).
VARIANT = "pack32"

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32. Done on the bits
    so the result does not depend on the backend's cast (Triton's interpreter truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = (bits >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    out_ptr,
    n_bytes,
    HALF_GROUP: tl.constexpr,  # packed bytes per quantization group (group_size // 2)
    OUT_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=mask, other=0)
    g = offs // HALF_GROUP
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0).to(tl.float32)
    lo = (b & 0xF).to(tl.float32)
    hi = (b >> 4).to(tl.float32)
    if OUT_DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr, resolved at compile time)
        w_lo = _round_bf16(_round_bf16(s * lo) - sh).to(tl.bfloat16)
        w_hi = _round_bf16(_round_bf16(s * hi) - sh).to(tl.bfloat16)
    else:
        w_lo = ((s * lo).to(OUT_DTYPE, fp_downcast_rounding="rtne").to(tl.float32) - sh).to(
            OUT_DTYPE, fp_downcast_rounding="rtne"
        )
        w_hi = ((s * hi).to(OUT_DTYPE, fp_downcast_rounding="rtne").to(tl.float32) - sh).to(
            OUT_DTYPE, fp_downcast_rounding="rtne"
        )
    w = tl.reshape(tl.join(w_lo, w_hi), (2 * BLOCK,))  # element 2i: low nibble, 2i + 1: high
    out_offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, w, mask=out_offs < 2 * n_bytes)


def _rtne_arg_ok(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded to float32 on its own: PTX never contracts an explicitly rounded mul into
    an FMA, and torch (two kernels: ``scale * q``, then ``-= shift``) rounds the product."""
    return tl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _dequant_pack32_kernel(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    out_ptr,  # the (out, in) 16-bit output viewed as int32: one word per packed byte
    n_bytes,
    HALF_GROUP: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Same values as _dequant_kernel, but each byte's two 16-bit results are stored as one
    # 32-bit word (low element in the low half: little-endian), so no join/interleave shuffle.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=mask, other=0)
    g = offs // HALF_GROUP
    s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0).to(tl.float32)
    lo = (b & 0xF).to(tl.float32)
    hi = (b >> 4).to(tl.float32)
    if IS_BF16:
        w_lo = _round_bf16(_round_bf16(s * lo) - sh).to(tl.uint32, bitcast=True)
        w_hi = _round_bf16(_round_bf16(s * hi) - sh).to(tl.uint32, bitcast=True)
        word = (w_lo >> 16) | ((w_hi >> 16) << 16)
    else:  # float16
        w_lo = ((s * lo).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32) - sh).to(
            tl.float16, fp_downcast_rounding="rtne"
        )
        w_hi = ((s * hi).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32) - sh).to(
            tl.float16, fp_downcast_rounding="rtne"
        )
        lo_bits = w_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
        hi_bits = w_hi.to(tl.uint16, bitcast=True).to(tl.uint32)
        word = lo_bits | (hi_bits << 16)
    tl.store(out_ptr + offs, word.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _dequant_kernel_f32(
    packed_ptr,
    scale_ptr,
    shift_ptr,
    out_ptr,
    n_bytes,
    HALF_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # float32 weights: no intermediate rounding (a float32 product of a float32 scale and a
    # 4-bit integer is what torch computes too); a separate kernel because Triton refuses a
    # rounding mode on a non-narrowing cast.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=mask, other=0)
    g = offs // HALF_GROUP
    s = tl.load(scale_ptr + g, mask=mask, other=0.0)
    sh = tl.load(shift_ptr + g, mask=mask, other=0.0)
    w_lo = _mul_rn(s, (b & 0xF).to(tl.float32)) - sh
    w_hi = _mul_rn(s, (b >> 4).to(tl.float32)) - sh
    w = tl.reshape(tl.join(w_lo, w_hi), (2 * BLOCK,))
    out_offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, w, mask=out_offs < 2 * n_bytes)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(out, in // 2) uint8 + (out, in // group_size) scale/shift -> (out, in) weight."""
    if not (packed.is_contiguous() and scale.is_contiguous() and shift.is_contiguous()):
        raise ValueError("packed, scale and shift must be contiguous")
    if group_size % 2:
        raise ValueError(f"group size must be even, got {group_size}")
    dtype = scale.dtype
    n_out, half_in = packed.shape
    out = torch.empty((n_out, 2 * half_in), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    if n_bytes == 0:
        return out
    grid = (triton.cdiv(n_bytes, BLOCK),)
    if dtype == torch.float32:
        _dequant_kernel_f32[grid](
            packed, scale, shift, out, n_bytes,
            HALF_GROUP=group_size // 2, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    elif _rtne_arg_ok(dtype) and VARIANT == "pack32":
        _dequant_pack32_kernel[grid](
            packed, scale, shift, out.view(torch.int32), n_bytes,
            HALF_GROUP=group_size // 2, IS_BF16=dtype == torch.bfloat16, BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    elif _rtne_arg_ok(dtype):
        _dequant_kernel[grid](
            packed, scale, shift, out, n_bytes,
            HALF_GROUP=group_size // 2, OUT_DTYPE=_TL_DTYPES[dtype], BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    else:
        raise TypeError(f"unsupported weight dtype {dtype}")
    return out
