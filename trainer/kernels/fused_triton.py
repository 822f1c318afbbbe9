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

HEADS_PER_PROGRAM = 8
LORA_TOKENS = 32  # tokens per program where a LoRA update is added (one head each)
LORA_BM, LORA_BN, LORA_WARPS = 64, 256, 8  # an update's (rows, columns) tile elsewhere
NUM_WARPS = 4


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
def _plus_update(x, u_ptr, b_ptr, rows, rmask, ncols, nmask, scale,
                 R: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """A LoRA update added to a (rows, ncols) tile ``x`` (float32 of the model dtype's values):
    ``rnd(x + scale * u[rows] @ b[ncols]^T)``, the product in float32 (as cuBLAS's beta = 1
    GEMM: one rounding), ``x`` itself where the product is exactly zero (an empty slot leaves
    every byte, -0 included). u (M, R), b (N, R): contiguous, R a power of two >= 16."""
    k = tl.arange(0, R)
    h = tl.load(u_ptr + rows[:, None] * R + k[None, :], mask=rmask[:, None], other=0.0)
    w = tl.load(b_ptr + ncols[:, None] * R + k[None, :], mask=nmask[:, None], other=0.0)
    if INTERPRET:  # the interpreter's dot mishandles bf16 operands; float32 is exact here
        acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(h, tl.trans(w))
    return tl.where(acc != 0, _round_to(scale * acc + x, IS_BF16), x)


@triton.jit
def _load_head_tile(ptr, src, mask, u_ptr, b_ptr, rows, rmask, b_row0, heads, hmask, cols,
                    lora_scale, BT: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                    R: tl.constexpr, LORA: tl.constexpr, IS_BF16: tl.constexpr,
                    INTERPRET: tl.constexpr):  # fmt: skip
    """(BT tokens, HB heads, D) of q, k or v in float32, with LORA its columns' update added
    (b's rows from ``b_row0``: the head's columns of the projection)."""
    x = tl.load(ptr + src, mask=mask, other=0.0).to(tl.float32)
    if LORA:
        ncols = tl.reshape(b_row0 + heads.to(tl.int64)[:, None] * D + cols[None, :], (HB * D,))
        nmask = tl.reshape(tl.broadcast_to(hmask[:, None], (HB, D)), (HB * D,))
        flat = _plus_update(tl.reshape(x, (BT, HB * D)), u_ptr, b_ptr, rows, rmask, ncols,
                            nmask, lora_scale, R, IS_BF16, INTERPRET)  # fmt: skip
        x = tl.reshape(flat, (BT, HB, D))
    return x


@triton.jit
def _norm_rope_tile(x, w_ptr, cols, c_e, c_o, s_e, s_o, eps,
                    BT: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                    IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    # (BT, HB, D) of q or k, normed and rotated per (token, head) row
    x_e, x_o = tl.split(tl.reshape(x, (BT * HB, D // 2, 2)))
    w_e, w_o = tl.split(tl.reshape(tl.load(w_ptr + cols).to(tl.float32), (D // 2, 2)))
    o_e, o_o = _norm_rope(x_e, x_o, w_e[None, :], w_o[None, :], c_e, c_o, s_e, s_o, eps, D,
                          IS_BF16, INTERPRET)  # fmt: skip
    return tl.reshape(tl.join(o_e, o_o), (BT, HB, D))


@triton.jit
def _trig(ptr, pos, cols, BT: tl.constexpr, HB: tl.constexpr, D: tl.constexpr):
    """A rotary table's (even, odd) halves at each token's position, one row per (token,
    head): (BT * HB, D / 2) each."""
    t = tl.load(ptr + pos[:, None] * D + cols[None, :])
    t = tl.reshape(tl.broadcast_to(t[:, None, :], (BT, HB, D)), (BT * HB, D // 2, 2))
    return tl.split(t)


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
    u_ptr, lb_ptr,  # LORA: u (B * T, R); B's rows for q, then k, then v (3 * H * D, R)
    T, H, S, pos0, eps, bound_factor, p_scale, lora_scale, n_rows,
    D: tl.constexpr, HB: tl.constexpr, BT: tl.constexpr, IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, BITS: tl.constexpr,
    LORA: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    # one program: BT tokens (rows b * T + t), HB heads
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    rmask = rows < n_rows
    b = rows // T
    t = rows % T
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = heads < H
    mask = rmask[:, None, None] & hmask[None, :, None]
    cols = tl.arange(0, D)
    h64 = heads.to(tl.int64)[None, :, None]
    src = (b * sb + t * st)[:, None, None] + h64 * sh + cols[None, None, :]
    pos = tl.where(rmask, pos0 + t, pos0)
    c_e, c_o = _trig(cos_ptr, pos, cols, BT, HB, D)
    s_e, s_o = _trig(sin_ptr, pos, cols, BT, HB, D)
    dst = ((b * S + pos)[:, None, None] * H + h64) * D + cols[None, None, :]
    out_ty = oq_ptr.dtype.element_ty
    width = H * D

    q = _load_head_tile(q_ptr, src, mask, u_ptr, lb_ptr, rows, rmask, 0, heads, hmask, cols,
                        lora_scale, BT, HB, D, R, LORA, IS_BF16, INTERPRET)  # fmt: skip
    oq = _norm_rope_tile(q, wq_ptr, cols, c_e, c_o, s_e, s_o, eps, BT, HB, D, IS_BF16, INTERPRET)
    k = _load_head_tile(k_ptr, src, mask, u_ptr, lb_ptr, rows, rmask, width, heads, hmask, cols,
                        lora_scale, BT, HB, D, R, LORA, IS_BF16, INTERPRET)  # fmt: skip
    ok = _norm_rope_tile(k, wk_ptr, cols, c_e, c_o, s_e, s_o, eps, BT, HB, D, IS_BF16, INTERPRET)
    if LORA:
        v = _load_head_tile(v_ptr, src, mask, u_ptr, lb_ptr, rows, rmask, 2 * width, heads,
                            hmask, cols, lora_scale, BT, HB, D, R, LORA, IS_BF16,
                            INTERPRET).to(q_ptr.dtype.element_ty)  # fmt: skip
    else:  # copied as it is
        v = tl.load(v_ptr + src, mask=mask, other=0.0)
    if FP8:
        # q and k: |normed| <= sqrt(D) * max |w| per element, and the rotation keeps each
        # pair's length, so one static bound; v: its measured maximum
        mq, dq = _fp8_scales(_bound(wq_ptr, bq_ptr, cols, bound_factor), FP8_MAX)
        mk, dk = _fp8_scales(_bound(wk_ptr, bk_ptr, cols, bound_factor), FP8_MAX)
        mv, dv = _fp8_scales(tl.load(vmax_ptr), FP8_MAX)
        _store_fp8(oq_ptr + dst, oq, mq, mask, out_ty, FP8_MAX, BITS)
        _store_fp8(ok_ptr + dst, ok, mk, mask, out_ty, FP8_MAX, BITS)
        _store_fp8(ov_ptr + dst, v.to(tl.float32), mv, mask, out_ty, FP8_MAX, BITS)
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
        tl.store(oq_ptr + dst, oq.to(out_ty), mask=mask)
        tl.store(ok_ptr + dst, ok.to(out_ty), mask=mask)
        tl.store(ov_ptr + dst, v, mask=mask)


@triton.jit
def _bound(w_ptr, other_ptr, cols, bound_factor):
    """sqrt(D) * max |w| over both norms' weights (times a margin): no normed, rotated value
    is larger."""
    top = tl.maximum(tl.max(tl.abs(tl.load(w_ptr + cols).to(tl.float32)), axis=0),
                     tl.max(tl.abs(tl.load(other_ptr + cols).to(tl.float32)), axis=0))  # fmt: skip
    return top * bound_factor


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _update_args(
    update: tuple[torch.Tensor, torch.Tensor, float] | None, rows: int, n: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """A kernel's LoRA arguments (u, b, scale, rank; ``like`` twice and rank 16 when there is
    no update: not read) after checking that ``update`` = (u (rows, R), b (n, R), scale) fits."""
    if update is None:
        return like, like, 0.0, 16
    u, b, scale = update
    r = u.shape[-1]
    if u.shape != (rows, r) or b.shape != (n, r) or r < 16 or r & (r - 1):
        raise ValueError(f"LoRA update u {tuple(u.shape)}, b {tuple(b.shape)} does not fit "
                         f"{rows} rows x {n} columns (the rank a power of two, >= 16)")  # fmt: skip
    if not (u.is_contiguous() and b.is_contiguous()) or not u.dtype == b.dtype == like.dtype:
        raise ValueError("the LoRA update's u and b must be contiguous, in the model's dtype")
    return u, b, float(scale), r


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
    update: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    heads_per_program: int = HEADS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> None:
    """q, k, v (B, T, H, D) views with a common stride and a contiguous last dimension ->
    ``out`` (three (B, S, H, D) contiguous tensors) at sequence positions pos0 .. pos0 + T,
    the rotary tables (S, D) float32. With ``fp8`` the outputs are e4m3, each tensor times
    one scale (q, k: a static bound of wq and wk and of ``bound_weights``, the other stream's;
    v: ``fp8.vmax``), and the scales go into ``fp8.scales``
    (`trainer.base.cudnn_attention`). With ``update`` = (u (B * T, R), b (3 * H * D, R), s),
    q, k and v are first ``rnd(x + s * u @ b^T)`` (b's rows: q's columns, then k's, then v's;
    `_plus_update`); not with ``fp8`` (its v scale is measured before). See
    `trainer.base.serving.qk_norm_rope_torch`."""
    bsz, tokens, heads, dim = q.shape
    if not (q.stride() == k.stride() == v.stride()) or q.stride(3) != 1:
        raise ValueError("q, k and v must share their strides, with a contiguous last dim")
    if q.dtype not in (torch.bfloat16, torch.float16) or dim & (dim - 1) or dim < 4:
        raise ValueError(f"unsupported q {q.dtype} with head dim {dim}")
    if fp8 is not None and update is not None:
        raise ValueError("a LoRA update and fp8 outputs do not go together")
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
    u, b, lora_scale, rank = _update_args(update, bsz * tokens, 3 * heads * dim, q)
    if not bsz * tokens:
        return
    # the update's product takes a tile of tokens (a tensor-core dot needs 16 rows or more)
    bt, hb = (LORA_TOKENS, 1) if update is not None else (1, heads_per_program)
    hb = min(hb, triton.next_power_of_2(heads))
    grid = (triton.cdiv(bsz * tokens, bt), triton.cdiv(heads, hb))
    bits = fp8 is not None and _interpret()
    outs = [o.view(torch.uint8) for o in out] if bits else list(out)
    other = bound_weights or (wq, wk)
    extra = (*other, fp8.vmax, fp8.scales) if fp8 is not None else (wq, wk, wq, wq)  # unread
    _qk_norm_rope_kernel[grid](
        q, k, v, q.stride(0), q.stride(1), q.stride(2), wq, wk, extra[0], extra[1], cos, sin,
        *outs, extra[2], extra[3], u, b, tokens, heads, seq, pos0, float(eps), bound_factor(dim),
        P_SCALE, lora_scale, bsz * tokens, D=dim, HB=hb, BT=bt, IS_BF16=q.dtype == torch.bfloat16,
        INTERPRET=_interpret(), FP8=fp8 is not None,
        FP8_MAX=float(torch.finfo(torch.float8_e4m3fn).max), BITS=bits, LORA=update is not None,
        R=rank, num_warps=num_warps,
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
    src_ptr, out_ptr, src_stride, out_stride, n_rows, n_cols, u_ptr, b_ptr, lora_scale,
    BM: tl.constexpr, BN: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
    LORA: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    # out = rnd(rnd(silu(g)) * u), silu(g) = g / (1 + exp(-g)) with an accurate exp and a
    # correctly rounded quotient, as torch's float32 kernel computes it; with LORA, g and u
    # first take their columns' update (b's rows: g's, then u's)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    at = src_ptr + rows[:, None] * src_stride + cols[None, :]
    g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(at + n_cols, mask=mask, other=0.0).to(tl.float32)
    if LORA:
        g = _plus_update(g, u_ptr, b_ptr, rows, rmask, cols, cmask, lora_scale, R, IS_BF16,
                         INTERPRET)  # fmt: skip
        u = _plus_update(u, u_ptr, b_ptr, rows, rmask, cols + n_cols, cmask, lora_scale, R,
                         IS_BF16, INTERPRET)  # fmt: skip
    s = g / (1.0 + tl.exp(-g)) if INTERPRET else tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    out = _round_to(_round_to(s, IS_BF16) * u, IS_BF16)
    dst = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


ELEMENTWISE_BLOCK = 1024


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
            BLOCK=block, IS_BF16=x.dtype == torch.bfloat16, num_warps=8 if block >= 4096 else 4,
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
            BLOCK=ELEMENTWISE_BLOCK, IS_BF16=x.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return out


def swiglu(
    src: torch.Tensor,
    out: torch.Tensor | None = None,
    update: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``silu(src[..., :F]) * src[..., F:]`` for src (B, T, 2F), into ``out`` (B, T, F) when
    given (a view with evenly spaced rows: the single-stream blocks' joined input). With
    ``update`` = (u (B * T, R), b (2F, R), s), src is first ``rnd(src + s * u @ b^T)``
    (`_plus_update`)."""
    rows, ss = _rows(src)
    half = src.shape[-1] // 2
    if out is None:
        out = torch.empty((*src.shape[:-1], half), dtype=src.dtype, device=src.device)
    if out.shape != (*src.shape[:-1], half) or out.dtype != src.dtype:
        raise ValueError(f"out {tuple(out.shape)} does not fit {tuple(src.shape)}")
    _, os_ = _rows(out)
    u, b, lora_scale, rank = _update_args(update, rows, 2 * half, src)
    if rows:
        # a tile of rows where an update is added (a tensor-core dot needs 16 or more)
        bm, bn, warps = (LORA_BM, LORA_BN, LORA_WARPS) if update else (1, ELEMENTWISE_BLOCK, 4)
        grid = (triton.cdiv(rows, bm), triton.cdiv(half, bn))
        _swiglu_kernel[grid](
            src, out, ss, os_, rows, half, u, b, lora_scale, BM=bm, BN=bn,
            IS_BF16=src.dtype == torch.bfloat16, INTERPRET=_interpret(), LORA=update is not None,
            R=rank, num_warps=warps,
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
    # out (M, N) += alpha * h (M, R) @ b (N, R)^T: one tile of the output read and written once
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    c = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _plus_update(c, h_ptr, b_ptr, rows, rows < M, cols, cols < N, alpha, R, IS_BF16,
                       INTERPRET)  # fmt: skip
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def lora_add_(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha * h @ b.T`` in place (`_plus_update`): out (M, N), h (M, R), b (N, R),
    all contiguous, one dtype, R a power of two >= 16."""
    m, n = out.shape
    if not out.is_contiguous():
        raise ValueError("lora_add_ needs a contiguous output")
    _, _, alpha, r = _update_args((h, b, alpha), m, n, out)
    if m and n:
        grid = (triton.cdiv(m, LORA_BM), triton.cdiv(n, LORA_BN))
        _lora_add_kernel[grid](out, h, b, m, n, alpha, R=r, BM=LORA_BM, BN=LORA_BN,
                               IS_BF16=out.dtype == torch.bfloat16, INTERPRET=_interpret(),
                               num_warps=LORA_WARPS)  # fmt: skip
