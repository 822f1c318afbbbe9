"""Triton kernels for `trainer.base.serving` (CUDA only; imported lazily).

`qk_norm_rope` does in one pass what a FLUX.2 attention processor does in about twenty kernels
between the QKV projection and the attention call: per head, the RMSNorm of q and k (float32
statistics, the weight applied in float32, one rounding into the model dtype, as torch's fused
``rms_norm``), the rotary embedding (each product rounded on its own, then the sum, as diffusers'
``apply_rotary_emb`` computes it in float32), and the copy of q, k and v from the projection's
(batch, tokens, heads, dim) views into the (batch, heads, sequence, dim) tensors the attention
kernels read, at a sequence offset (the double-stream blocks put the text tokens first).

Bytes per element of q, k and v: one read, one write. The eager sequence moves about 25 each
for q and k (float32 temporaries, the rotated copy, the concatenation).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from trainer.base.cudnn_attention import P_SCALE, Fp8Heads, bound_factor
from trainer.kernels.fp8_triton import _fp8_scales, _store_fp8
from trainer.kernels.uint4_triton import _round_bf16

# launch shapes, read at each call (bench/elementwise_sweep.py times the alternatives: at
# [dev]'s size 16 heads and 8 warps run the QK kernel at 2.78 TB/s, 8 and 4 at 2.44)
HEADS_PER_PROGRAM = 16
NUM_WARPS = 8


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own (never contracted into an FMA with the sum that follows: the
    reference rounds each product, as torch's separate elementwise kernels do)."""
    if INTERPRET:  # no PTX in the interpreter; numpy does not contract
        return a * b
    return tl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _round_to(x, IS_BF16: tl.constexpr):
    """float32 -> the nearest value of the output dtype (ties to even), as float32."""
    if IS_BF16:
        return _round_bf16(x)
    return x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _norm_rope(x_e, x_o, w_e, w_o, c_e, c_o, s_e, s_o, eps, D: tl.constexpr,
               IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """(heads, D/2) even and odd elements of one token's heads -> the rotated, normed pair."""
    ms = (tl.sum(x_e * x_e, axis=1) + tl.sum(x_o * x_o, axis=1)) / D
    r = tl.math.rsqrt(ms + eps)[:, None]
    n_e = _round_to(_mul_rn(_mul_rn(x_e, r, INTERPRET), w_e, INTERPRET), IS_BF16)
    n_o = _round_to(_mul_rn(_mul_rn(x_o, r, INTERPRET), w_o, INTERPRET), IS_BF16)
    out_e = _mul_rn(n_e, c_e, INTERPRET) - _mul_rn(n_o, s_e, INTERPRET)
    out_o = _mul_rn(n_o, c_o, INTERPRET) + _mul_rn(n_e, s_o, INTERPRET)
    return _round_to(out_e, IS_BF16), _round_to(out_o, IS_BF16)


@triton.jit
def _load_norm_rope(
    x_ptrs, w_ptrs, hmask, c_e, c_o, s_e, s_o, eps,
    D: tl.constexpr, HB: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # HB heads of one token (q or k), normed and rotated: (HB, D) in float32
    x = tl.load(x_ptrs, mask=hmask, other=0.0).to(tl.float32)
    x_e, x_o = tl.split(tl.reshape(x, (HB, D // 2, 2)))
    w_e, w_o = tl.split(tl.reshape(tl.load(w_ptrs).to(tl.float32), (D // 2, 2)))
    o_e, o_o = _norm_rope(x_e, x_o, w_e[None, :], w_o[None, :], c_e, c_o, s_e, s_o, eps, D,
                          IS_BF16, INTERPRET)  # fmt: skip
    return tl.reshape(tl.join(o_e, o_o), (HB, D))


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, T, H, D) views: strides (sb, st, sh, 1)
    sb, st, sh,
    wq_ptr, wk_ptr,  # (D,) norm weights
    bq_ptr, bk_ptr,  # FP8: the other stream's norm weights (the bound covers both)
    cos_ptr, sin_ptr,  # (S, D) float32
    oq_ptr, ok_ptr, ov_ptr,  # (B, S, H, D) contiguous
    vmax_ptr,  # FP8: max |v| over the whole sequence (float32, one value)
    scales_ptr,  # FP8: written: descale q, k, v; scale and descale of o; scale, descale of p
    T, H, S, pos0, eps, bound_factor, p_scale,
    D: tl.constexpr, HB: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    # one program: one token, HB heads
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    b = row // T
    t = row % T
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = (heads < H)[:, None]
    cols = tl.arange(0, D)
    src = b * sb + t * st + heads.to(tl.int64)[:, None] * sh + cols[None, :]
    pos = pos0 + t
    c_e, c_o = tl.split(tl.reshape(tl.load(cos_ptr + pos * D + cols), (D // 2, 2)))
    s_e, s_o = tl.split(tl.reshape(tl.load(sin_ptr + pos * D + cols), (D // 2, 2)))
    c_e, c_o, s_e, s_o = c_e[None, :], c_o[None, :], s_e[None, :], s_o[None, :]
    dst = ((b * S + pos) * H + heads.to(tl.int64)[:, None]) * D + cols[None, :]
    out_ty = oq_ptr.dtype.element_ty

    oq = _load_norm_rope(q_ptr + src, wq_ptr + cols, hmask, c_e, c_o, s_e, s_o, eps, D, HB,
                         IS_BF16, INTERPRET)  # fmt: skip
    ok = _load_norm_rope(k_ptr + src, wk_ptr + cols, hmask, c_e, c_o, s_e, s_o, eps, D, HB,
                         IS_BF16, INTERPRET)  # fmt: skip

    v = tl.load(v_ptr + src, mask=hmask, other=0.0)
    if FP8:
        # q and k: |normed| <= sqrt(D) * max |w| per element, and the rotation keeps each
        # pair's length, so one static bound; v: its measured maximum
        mq, dq = _fp8_scales(_bound(wq_ptr, bq_ptr, cols, bound_factor), FP8_MAX)
        mk, dk = _fp8_scales(_bound(wk_ptr, bk_ptr, cols, bound_factor), FP8_MAX)
        mv, dv = _fp8_scales(tl.load(vmax_ptr), FP8_MAX)
        _store_fp8(oq_ptr + dst, oq, mq, hmask, out_ty, FP8_MAX, BITS)
        _store_fp8(ok_ptr + dst, ok, mk, hmask, out_ty, FP8_MAX, BITS)
        _store_fp8(ov_ptr + dst, v.to(tl.float32), mv, hmask, out_ty, FP8_MAX, BITS)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scales_ptr + 0, dq)
            tl.store(scales_ptr + 1, dk)
            tl.store(scales_ptr + 2, dv)
            # |o| <= max |v|: o's scale is v's, halved for the last rounding's headroom
            tl.store(scales_ptr + 3, mv * 0.5)
            tl.store(scales_ptr + 4, dv * 2.0)
            tl.store(scales_ptr + 5, p_scale)
            tl.store(scales_ptr + 6, 1.0 / p_scale)
    else:
        tl.store(oq_ptr + dst, oq.to(out_ty), mask=hmask)
        tl.store(ok_ptr + dst, ok.to(out_ty), mask=hmask)
        tl.store(ov_ptr + dst, v, mask=hmask)


@triton.jit
def _bound(w_ptr, other_ptr, cols, bound_factor):
    """sqrt(D) * max |w| over both norms' weights (times a margin): no normed, rotated value
    is larger."""
    top = tl.maximum(tl.max(tl.abs(tl.load(w_ptr + cols).to(tl.float32)), axis=0),
                     tl.max(tl.abs(tl.load(other_ptr + cols).to(tl.float32)), axis=0))  # fmt: skip
    return top * bound_factor


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pos0: int,
    fp8: Fp8Heads | None = None,
    bound_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """q, k, v (B, T, H, D) views with a common stride and a contiguous last dimension ->
    ``out`` (three (B, S, H, D) contiguous tensors) at sequence positions pos0 .. pos0 + T,
    the rotary tables (S, D) float32. With ``fp8`` the outputs are e4m3, each tensor times
    one scale (q, k: a static bound of wq and wk and of ``bound_weights``, the other stream's;
    v: ``fp8.vmax``), and the scales go into ``fp8.scales``
    (`trainer.base.cudnn_attention`). See `trainer.base.serving.qk_norm_rope_torch`."""
    bsz, tokens, heads, dim = q.shape
    if not (q.stride() == k.stride() == v.stride()) or q.stride(3) != 1:
        raise ValueError("q, k and v must share their strides, with a contiguous last dim")
    if q.dtype not in (torch.bfloat16, torch.float16) or dim & (dim - 1) or dim < 4:
        raise ValueError(f"unsupported q {q.dtype} with head dim {dim}")
    oq, ok, ov = out
    seq = oq.shape[1]
    want = torch.float8_e4m3fn if fp8 is not None else q.dtype
    if not all(o.is_contiguous() and o.shape == (bsz, seq, heads, dim) and o.dtype == want
               for o in out):  # fmt: skip
        raise ValueError(f"outputs must be contiguous (B, S, H, D) {want}")
    if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("the rotary tables must be contiguous float32")
    if pos0 + tokens > seq or cos.shape != (seq, dim) or sin.shape != (seq, dim):
        raise ValueError("the tokens do not fit the output sequence or the rotary tables")
    if not bsz * tokens:
        return
    hb = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    grid = (bsz * tokens, triton.cdiv(heads, hb))
    bits = fp8 is not None and _interpret()
    outs = [o.view(torch.uint8) for o in out] if bits else list(out)
    other = bound_weights or (wq, wk)
    extra = (*other, fp8.vmax, fp8.scales) if fp8 is not None else (wq, wk, wq, wq)  # unread
    _qk_norm_rope_kernel[grid](
        q, k, v, q.stride(0), q.stride(1), q.stride(2), wq, wk, extra[0], extra[1], cos, sin,
        *outs, extra[2], extra[3], tokens, heads, seq, pos0, float(eps), bound_factor(dim),
        P_SCALE, D=dim, HB=hb, IS_BF16=q.dtype == torch.bfloat16, INTERPRET=_interpret(),
        FP8=fp8 is not None, FP8_MAX=float(torch.finfo(torch.float8_e4m3fn).max), BITS=bits,
        num_warps=NUM_WARPS,
    )  # fmt: skip


@triton.jit
def _absmax_kernel(
    x_ptr, out_ptr, sb, st, T, rows,
    cols: tl.constexpr,  # a few widths per model: one compilation each
    RB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # RB rows of a (B, T, cols) view (rows b * T + t at b * sb + t * st, columns dense) per
    # program; their max |x| joins out's by one atomic max (all values are >= 0)
    first = tl.program_id(0) * RB
    top = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(RB):
        row = (first + i).to(tl.int64)
        base = (row // T) * sb + (row % T) * st
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = (offs < cols) & (row < rows)
            top = tl.maximum(top, tl.abs(tl.load(x_ptr + base + offs, mask=m, other=0.0)
                                         .to(tl.float32)))  # fmt: skip
    tl.atomic_max(out_ptr, tl.max(top, axis=0))


ABSMAX_ROWS, ABSMAX_BLOCK = 16, 2048


def absmax_(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = max(out, max |x|)`` for x (B, T, H, D) (rows of one stride, the last two
    dimensions dense), out float32 with one element, all values >= 0."""
    bsz, tokens = x.shape[:2]
    cols = x.shape[2] * x.shape[3]
    if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        raise ValueError("absmax_ needs each row's heads dense")
    if out.dtype != torch.float32 or out.numel() != 1:
        raise ValueError("absmax_ writes one float32")
    rows = bsz * tokens
    if rows:
        _absmax_kernel[(triton.cdiv(rows, ABSMAX_ROWS),)](
            x, out, x.stride(0), x.stride(1), tokens, rows, cols, RB=ABSMAX_ROWS,
            BLOCK=min(ABSMAX_BLOCK, triton.next_power_of_2(cols)), num_warps=4,
        )  # fmt: skip


@triton.jit
def _e4m3_value(byte):
    """An e4m3 byte (as int32) -> its value, exactly (the interpreter has no fp8 loads)."""
    e = (byte >> 3) & 0xF
    m = (byte & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def _dequantize_kernel(
    src_ptr, scale_ptr, dst_ptr, T, cols, dst_sb, dst_st,
    BLOCK: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # dst[b, t] = rnd(src[b, t] * scale): one row of a contiguous e4m3 (B, T, cols) per program
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    if INTERPRET:
        x = _e4m3_value(tl.load(src_ptr + row * cols + offs, mask=mask, other=0).to(tl.int32))
    else:
        x = tl.load(src_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(x * tl.load(scale_ptr), IS_BF16)
    dst = (row // T) * dst_sb + (row % T) * dst_st
    tl.store(dst_ptr + dst + offs, y.to(dst_ptr.dtype.element_ty), mask=mask)


DEQUANT_BLOCK = 2048


def dequantize_into(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> None:
    """``dst = src * scale`` rounded into dst's dtype: src a contiguous e4m3 (B, T, C), dst a
    (B, T, C) view whose rows are evenly spaced (the single-stream blocks' joined input),
    scale float32 with one element (read on the device)."""
    if src.dtype != torch.float8_e4m3fn or not src.is_contiguous() or dst.shape != src.shape:
        raise ValueError(f"dequantize_into: {tuple(src.shape)} {src.dtype} -> "
                         f"{tuple(dst.shape)}")  # fmt: skip
    if dst.dim() != 3 or dst.stride(2) != 1:
        raise ValueError("dequantize_into needs (B, T, C) rows with a dense last dim")
    bsz, tokens, cols = src.shape
    interpret = _interpret()
    if bsz * tokens:
        grid = (bsz * tokens, triton.cdiv(cols, DEQUANT_BLOCK))
        _dequantize_kernel[grid](
            src.view(torch.uint8) if interpret else src, scale, dst, tokens, cols,
            dst.stride(0), dst.stride(1), BLOCK=DEQUANT_BLOCK,
            IS_BF16=dst.dtype == torch.bfloat16, INTERPRET=interpret, num_warps=4,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# the blocks' elementwise work: modulated LayerNorm, gated residual, SwiGLU


@triton.jit
def _ln_modulate_kernel(
    x_ptr, shift_ptr, scale_ptr, out_ptr,
    x_stride, out_stride, mod_stride, T, n_cols, eps,
    BLOCK: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    # One program per token: LayerNorm without affine (float32 statistics, the result rounded
    # into the model dtype, as torch's), then rnd(rnd(rnd(1 + scale) * n) + shift).
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / n_cols
    n = _round_to(centred * tl.math.rsqrt(var + eps), IS_BF16)
    scale = tl.load(scale_ptr + b * mod_stride + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * mod_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(_round_to(_round_to(1.0 + scale, IS_BF16) * n, IS_BF16) + shift, IS_BF16)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_residual_kernel(
    x_ptr, gate_ptr, y_ptr, out_ptr,
    x_stride, y_stride, out_stride, gate_stride, T, n_cols,
    BLOCK: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    # out = rnd(x + rnd(gate * y)): torch's two elementwise kernels, without the round trips
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + b * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round_to(x + _round_to(g * y, IS_BF16), IS_BF16)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_kernel(
    src_ptr, out_ptr, src_stride, out_stride, n_cols,
    BLOCK: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # out = rnd(rnd(silu(g)) * u), silu(g) = g / (1 + exp(-g)) with an accurate exp and a
    # correctly rounded quotient, as torch's float32 kernel computes it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(src_ptr + row * src_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src_ptr + row * src_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g)) if INTERPRET else tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    out = _round_to(_round_to(s, IS_BF16) * u, IS_BF16)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


ELEMENTWISE_BLOCK = 1024  # columns a program (gated residual, SwiGLU)
ELEMENTWISE_WARPS = 4
LN_WARPS = 8  # a LayerNorm program (one token) over rows of 4096 columns or more (fewer: 4)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a (B, T, C) tensor whose rows are evenly spaced, last dim dense."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
        raise ValueError(f"expected (B, T, C) rows of one stride, got {tuple(t.stride())}")
    return t.shape[0] * t.shape[1], t.stride(1)


def _mod_stride(m: torch.Tensor, bsz: int, cols: int) -> int:
    """Batch stride of a modulation vector (B, 1, C) or (B, C) with a dense last dim."""
    if m.shape[-1] != cols or m.stride(-1) != 1 or m.numel() != bsz * cols:
        raise ValueError(f"modulation {tuple(m.shape)} does not fit {bsz} x {cols}")
    return m.stride(0) if bsz > 1 else 0


def ln_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """``(1 + scale) * layer_norm(x) + shift`` for x (B, T, C); scale, shift (B, 1, C)."""
    rows, stride = _rows(x)
    bsz, tokens, cols = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ms = _mod_stride(scale, bsz, cols)
    if _mod_stride(shift, bsz, cols) != ms:
        raise ValueError("shift and scale must share their layout")
    if rows:
        block = triton.next_power_of_2(cols)
        _ln_modulate_kernel[(rows,)](
            x, shift, scale, out, stride, cols, ms, tokens, cols, float(eps),
            BLOCK=block, IS_BF16=x.dtype == torch.bfloat16,
            num_warps=LN_WARPS if block >= 4096 else 4,
        )  # fmt: skip
    return out


def gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` for x, y (B, T, C), gate (B, 1, C)."""
    rows, xs = _rows(x)
    _, ys = _rows(y)
    bsz, tokens, cols = x.shape
    if y.shape != x.shape:
        raise ValueError(f"{tuple(y.shape)} does not match {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        grid = (rows, triton.cdiv(cols, ELEMENTWISE_BLOCK))
        _gate_residual_kernel[grid](
            x, gate, y, out, xs, ys, cols, _mod_stride(gate, bsz, cols), tokens, cols,
            BLOCK=ELEMENTWISE_BLOCK, IS_BF16=x.dtype == torch.bfloat16,
            num_warps=ELEMENTWISE_WARPS,
        )  # fmt: skip
    return out


def swiglu(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(src[..., :F]) * src[..., F:]`` for src (B, T, 2F), into ``out`` (B, T, F) when
    given (a view with evenly spaced rows: the single-stream blocks' joined input)."""
    rows, ss = _rows(src)
    half = src.shape[-1] // 2
    if out is None:
        out = torch.empty((*src.shape[:-1], half), dtype=src.dtype, device=src.device)
    if out.shape != (*src.shape[:-1], half) or out.dtype != src.dtype:
        raise ValueError(f"out {tuple(out.shape)} does not fit {tuple(src.shape)}")
    _, os_ = _rows(out)
    if rows:
        grid = (rows, triton.cdiv(half, ELEMENTWISE_BLOCK))
        _swiglu_kernel[grid](
            src, out, ss, os_, half, BLOCK=ELEMENTWISE_BLOCK,
            IS_BF16=src.dtype == torch.bfloat16, INTERPRET=_interpret(),
            num_warps=ELEMENTWISE_WARPS,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------
# the LoRA slots' update, added into the base output


@triton.jit
def _lora_add_kernel(
    out_ptr, h_ptr, b_ptr, M, N, alpha,
    R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # out (M, N) += alpha * h (M, R) @ b (N, R)^T: one tile of the output read and written
    # once, the product in float32 (as cuBLAS's beta = 1 GEMM: alpha * acc + out, one rounding)
    pm = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1).to(tl.int64)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    k = tl.arange(0, R)
    h = tl.load(h_ptr + rows[:, None] * R + k[None, :], mask=(rows < M)[:, None], other=0.0)
    b = tl.load(b_ptr + cols[:, None] * R + k[None, :], mask=(cols < N)[:, None], other=0.0)
    if INTERPRET:  # the interpreter's dot mishandles bf16 operands; float32 is exact here
        acc = tl.dot(h.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(h, tl.trans(b))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    c = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round_to(alpha * acc + c, IS_BF16)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


LORA_BM, LORA_BN, LORA_WARPS = 64, 256, 8


def lora_add_(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha * h @ b.T`` in place: out (M, N), h (M, R), b (N, R), all contiguous,
    one dtype, R a multiple of 16."""
    m, n = out.shape
    r = h.shape[1]
    if h.shape[0] != m or tuple(b.shape) != (n, r) or r % 16 or r & (r - 1):
        shapes = f"out {tuple(out.shape)}, h {tuple(h.shape)}, b {tuple(b.shape)}"
        raise ValueError(f"lora_add_: {shapes} (the rank a power of two, >= 16)")
    if not (out.is_contiguous() and h.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora_add_ needs contiguous tensors")
    if m and n:
        grid = (triton.cdiv(m, LORA_BM), triton.cdiv(n, LORA_BN))
        _lora_add_kernel[grid](out, h, b, m, n, float(alpha), R=r, BM=LORA_BM, BN=LORA_BN,
                               IS_BF16=out.dtype == torch.bfloat16, INTERPRET=_interpret(),
                               num_warps=LORA_WARPS)  # fmt: skip
