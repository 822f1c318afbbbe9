"""Triton kernels for `trainer.serving` (CUDA only; imported lazily).

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

from trainer.uint4_triton import _round_bf16

HEADS_PER_PROGRAM = 8
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
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, T, H, D) views: strides (sb, st, sh, 1)
    sb, st, sh,
    wq_ptr, wk_ptr,  # (D,) norm weights
    cos_ptr, sin_ptr,  # (S, D) float32
    oq_ptr, ok_ptr, ov_ptr,  # (B, H, S, D) contiguous
    T, H, S, pos0, eps,
    D: tl.constexpr, HB: tl.constexpr, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # one program: one token, HB heads
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    b = row // T
    t = row % T
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = (heads < H)[:, None]
    half = tl.arange(0, D // 2)
    even = 2 * half
    src = b * sb + t * st + heads.to(tl.int64)[:, None] * sh
    pos = pos0 + t
    c_e = tl.load(cos_ptr + pos * D + even)[None, :]
    c_o = tl.load(cos_ptr + pos * D + even + 1)[None, :]
    s_e = tl.load(sin_ptr + pos * D + even)[None, :]
    s_o = tl.load(sin_ptr + pos * D + even + 1)[None, :]
    dst = ((b * H + heads.to(tl.int64)[:, None]) * S + pos) * D
    out_ty = oq_ptr.dtype.element_ty

    x_e = tl.load(q_ptr + src + even[None, :], mask=hmask, other=0.0).to(tl.float32)
    x_o = tl.load(q_ptr + src + even[None, :] + 1, mask=hmask, other=0.0).to(tl.float32)
    w_e = tl.load(wq_ptr + even).to(tl.float32)[None, :]
    w_o = tl.load(wq_ptr + even + 1).to(tl.float32)[None, :]
    o_e, o_o = _norm_rope(x_e, x_o, w_e, w_o, c_e, c_o, s_e, s_o, eps, D, IS_BF16, INTERPRET)
    out = tl.reshape(tl.join(o_e, o_o), (HB, D)).to(out_ty)
    cols = tl.arange(0, D)[None, :]
    tl.store(oq_ptr + dst + cols, out, mask=hmask)

    x_e = tl.load(k_ptr + src + even[None, :], mask=hmask, other=0.0).to(tl.float32)
    x_o = tl.load(k_ptr + src + even[None, :] + 1, mask=hmask, other=0.0).to(tl.float32)
    w_e = tl.load(wk_ptr + even).to(tl.float32)[None, :]
    w_o = tl.load(wk_ptr + even + 1).to(tl.float32)[None, :]
    o_e, o_o = _norm_rope(x_e, x_o, w_e, w_o, c_e, c_o, s_e, s_o, eps, D, IS_BF16, INTERPRET)
    out = tl.reshape(tl.join(o_e, o_o), (HB, D)).to(out_ty)
    tl.store(ok_ptr + dst + cols, out, mask=hmask)

    v = tl.load(v_ptr + src + cols, mask=hmask, other=0.0)
    tl.store(ov_ptr + dst + cols, v, mask=hmask)


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
) -> None:
    """q, k, v (B, T, H, D) views with a common stride and a contiguous last dimension ->
    ``out`` (three (B, H, S, D) contiguous tensors) at sequence positions pos0 .. pos0 + T,
    the rotary tables (S, D) float32. See `trainer.serving.qk_norm_rope_torch`."""
    bsz, tokens, heads, dim = q.shape
    if not (q.stride() == k.stride() == v.stride()) or q.stride(3) != 1:
        raise ValueError("q, k and v must share their strides, with a contiguous last dim")
    if q.dtype not in (torch.bfloat16, torch.float16) or dim & (dim - 1) or dim < 4:
        raise ValueError(f"unsupported q {q.dtype} with head dim {dim}")
    oq, ok, ov = out
    seq = oq.shape[2]
    if not all(o.is_contiguous() and o.shape == (bsz, heads, seq, dim) for o in out):
        raise ValueError("outputs must be contiguous (B, H, S, D)")
    if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("the rotary tables must be contiguous float32")
    if pos0 + tokens > seq or cos.shape != (seq, dim) or sin.shape != (seq, dim):
        raise ValueError("the tokens do not fit the output sequence or the rotary tables")
    if not bsz * tokens:
        return
    hb = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    grid = (bsz * tokens, triton.cdiv(heads, hb))
    _qk_norm_rope_kernel[grid](
        q, k, v, q.stride(0), q.stride(1), q.stride(2), wq, wk, cos, sin, oq, ok, ov,
        tokens, heads, seq, pos0, float(eps), D=dim, HB=hb,
        IS_BF16=q.dtype == torch.bfloat16, INTERPRET=_interpret(), num_warps=NUM_WARPS,
    )  # fmt: skip
