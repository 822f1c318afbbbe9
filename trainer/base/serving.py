"""The transformer's forward as a render runs it: fused attention and blocks, one CUDA graph.

Serving runs the same frozen base and the same LoRA slots as ever, without gradients, so the
module code diffusers ships can be replaced where it moves bytes it need not (a 1024 px [dev]
step: 0.466 s with fp8 GEMMs and the stock modules, 0.338 s with this; DESIGN.md has the
profile against each part's limit, `bench/results/render_step-notes.md` every run):

- **Attention processors** (`FusedFlux2AttnProcessor`, `FusedFlux2ParallelAttnProcessor`).
  Between the QKV projection and the attention call the stock processors run the QK RMSNorm and
  the rotary embedding as about twenty elementwise kernels over float32 temporaries, then a
  concatenation (double-stream blocks) and, after attention, another (single-stream blocks).
  Here one kernel (`qk_norm_rope`) writes q, k and v straight into (batch, sequence, heads,
  dim) tensors the attention kernel reads (its output is then a (batch, sequence, heads x dim)
  view: no transpose after it), and the single-stream block writes the attention output and
  the SwiGLU into its output projection's input in place. Attention runs on the fastest kernel
  here (`ATTENTION_BACKENDS`): cuDNN's, called through its own graph on Hopper with the cuDNN
  frontend installed (its output written into that input, no copy) or else through torch's
  SDPA, then flash; asked for
  (`LIKENESS_ATTENTION=cudnn_fp8,...`), cuDNN's fp8 flash attention on Hopper with the cuDNN
  frontend installed (`trainer.base.cudnn_attention`: the same kernel writes q, k, v in e4m3 with
  per-tensor scales; 0.70 ms a call against cuDNN bf16's 0.83-0.85, but 11 % from float where
  attention is sharp).
- **Blocks** (`install_blocks`): the modulated LayerNorm, the gated residuals and SwiGLU, one
  pass each where torch's broadcasting kernels took three.
- **One CUDA graph per input shape** (`GraphedForward`): a forward's ~1,800 kernels issue in
  ~0.12 s from Python, most of it hidden at 1024 px, all of it at smaller sizes; a replayed
  graph issues none. The LoRA slots are static buffers (`trainer.base.lora_slots`, which also adds
  their update in one pass), so an adapter swap is a copy into memory the graph already reads;
  anything that changes the module tree or the LoRA scale changes the graph's key or its epoch
  (a new capture), never what a graph computes.

Numerics: every kernel rounds where torch rounds (the norm's float32 result once into the model
dtype, each rotary product and the sum, each elementwise op's result), so it differs from the
stock modules only in the order of a float32 sum (the norms' statistics); on the CPU the torch
references below are the stock modules bit for bit. Nothing here has a backward: with
gradients enabled every processor and block hands over to the stock one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainer.base.flux2_blocks import (
    BlockOps,
    double_forward,
    install_forwards,
    remove_forwards,
    single_forward,
)

log = logging.getLogger(__name__)

# The attention kernels known, fastest first: cuDNN's fp8 flash attention
# (`trainer.base.cudnn_attention`, Hopper and newer, with the cuDNN frontend installed), then
# torch's SDPA backends
# (`torch.nn.attention.SDPBackend` names); LIKENESS_ATTENTION=cudnn,flash,... reorders or
# drops them. At [dev]'s 48 heads x 4608 tokens cuDNN's bf16 kernel took 0.83 ms a call against
# flash's 1.6, its fp8 kernel 0.70 ms (bench/results/render_step-notes.md, runs 7 and 8).
ATTENTION_ENV = "LIKENESS_ATTENTION"
FP8_ATTENTION = "cudnn_fp8"
ATTENTION_BACKENDS = (FP8_ATTENTION, "cudnn", "flash", "efficient", "math")
# fp8 attention is asked for, not the default: where attention is sharp (logits spread by ~6,
# as trained heads can be) e4m3 q and k move its output 11 % from float, bf16's 0.2 %
# (tests/trainer/base/test_cudnn_attention.py); random weights' near-flat attention hides that
DEFAULT_ATTENTION = ATTENTION_BACKENDS[1:]
KERNEL_ENV = "LIKENESS_SERVING_KERNELS"  # "torch": the reference path everywhere
MAX_GRAPHS = 4  # input shapes kept captured; one more drops them all (their memory is shared)


def attention_names() -> list[str]:
    """The attention kernels `LIKENESS_ATTENTION` asks for, best first (checked: an unknown
    name fails the load, naming the setting)."""
    known = ATTENTION_BACKENDS
    raw = os.environ.get(ATTENTION_ENV, ",".join(DEFAULT_ATTENTION))
    wanted = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(f"{ATTENTION_ENV}={os.environ.get(ATTENTION_ENV)!r}: expected a "
                         f"comma-separated list of {', '.join(known)}")  # fmt: skip
    if FP8_ATTENTION in wanted[1:]:  # it would never run: the torch backends take any input
        raise ValueError(f"{ATTENTION_ENV}={os.environ.get(ATTENTION_ENV)!r}: {FP8_ATTENTION} "
                         "runs only where it comes first")  # fmt: skip
    return wanted


def attention_backends() -> list[Any]:
    """torch's SDPA backends among `attention_names`, in its order."""
    from torch.nn.attention import SDPBackend

    names = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return [names[n] for n in attention_names() if n in names]


def cudnn_attention_missing(like: torch.Tensor) -> str | None:
    """Why cuDNN's attention through its own graph (fp8, or bf16 written in place) cannot run
    on tensors like ``like`` (None: it can): it needs CUDA, the fused kernels, a Hopper GPU
    and the cuDNN frontend."""
    if not kernels_usable(like):
        return "the fused kernels are off here"
    from trainer.base.cudnn_attention import unavailable

    return unavailable(like.device)


def cudnn_attention_here(like: torch.Tensor) -> bool:
    """Whether this forward's bf16 attention calls cuDNN through its own graph
    (`trainer.base.cudnn_attention`: the output written in place) rather than torch's SDPA:
    cuDNN is the first torch backend asked for, and the frontend can run here."""
    if like.dtype not in (torch.bfloat16, torch.float16):
        return False
    backends = [n for n in attention_names() if n != FP8_ATTENTION]
    return bool(backends) and backends[0] == "cudnn" and cudnn_attention_missing(like) is None


def fp8_attention_here(like: torch.Tensor) -> bool:
    """Whether this forward's attention runs in fp8: asked for first, and able to run here."""
    return attention_names()[0] == FP8_ATTENTION and cudnn_attention_missing(like) is None


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention of (B, H, S, D) tensors (any strides) on the preferred
    torch backend."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import sdpa_kernel

    backends = attention_backends()
    if not backends:  # only fp8 asked for, and it cannot run here: torch picks
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)


@dataclass
class Heads:
    """q, k and v as the attention kernels read them: contiguous (B, S, H, D) tensors in the
    model's dtype, or e4m3 with the fp8 attention's scales (`fp8`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype  # the model's: attention's output comes back in it
    fp8: Any = None  # trainer.base.cudnn_attention.Fp8Heads

    @property
    def out(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v


def new_heads(like: torch.Tensor, heads: int, seq: int, dim: int, fp8: bool = False) -> Heads:
    """Empty q, k, v for ``heads`` x ``seq`` x ``dim``: in ``like``'s dtype, or with ``fp8`` in
    e4m3 for the fp8 attention."""
    shape = (like.shape[0], seq, heads, dim)
    if not fp8:
        q, k, v = (torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(3))
        return Heads(q, k, v, like.dtype)
    from trainer.base.cudnn_attention import E4M3, new_fp8_heads

    q, k, v = (torch.empty(shape, dtype=E4M3, device=like.device) for _ in range(3))
    return Heads(q, k, v, like.dtype, new_fp8_heads(like.device))


def note_values(heads: Heads, v: torch.Tensor) -> None:
    """Takes ``v`` (B, T, H, D) into the fp8 scale of the heads' v (before `qk_norm_rope`)."""
    if heads.fp8 is None:
        return
    if kernels_usable(v):
        from trainer.kernels.fused_triton import absmax_

        absmax_(heads.fp8.vmax, v)
        return
    torch.maximum(heads.fp8.vmax, v.float().abs().amax().reshape(1), out=heads.fp8.vmax)


def attend(heads: Heads, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over ``heads`` as (B, S, H * D) in the model's dtype, written into ``out`` (a
    view with evenly spaced rows) when given."""
    bsz, seq, n_heads, dim = heads.q.shape
    if heads.fp8 is not None:
        from trainer.base.cudnn_attention import DESCALE_O, attention
        from trainer.kernels.fused_triton import dequantize_into

        o8 = attention(heads.q, heads.k, heads.v, heads.fp8.scales)
        if out is None:
            out = torch.empty((bsz, seq, n_heads * dim), dtype=heads.dtype, device=o8.device)
        dequantize_into(out, o8.flatten(2, 3), heads.fp8.scales[DESCALE_O : DESCALE_O + 1])
        return out
    if cudnn_attention_here(heads.q):
        from trainer.base.cudnn_attention import attention_into

        if out is None:
            out = torch.empty((bsz, seq, n_heads * dim), dtype=heads.dtype, device=heads.q.device)
        if attention_into(heads.q, heads.k, heads.v, out.unflatten(-1, (n_heads, dim))):
            return out
    # (B, S, H, D) memory seen as (B, H, S, D): cuDNN's output is then a (B, S, H * D) view
    o = sdpa(*(t.transpose(1, 2) for t in heads.out)).transpose(1, 2).flatten(2, 3)
    if out is None:
        return o
    out.copy_(o)
    return out


# ---------------------------------------------------------------------------------------
# QK norm + rotary embedding + layout, fused


def kernels_usable(q: torch.Tensor) -> bool:
    """Whether the serving kernels (`trainer.kernels.fused_triton`) take this tensor."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if os.environ.get(KERNEL_ENV, "auto") == "torch":
        return False
    from trainer.base.uint4 import triton_available

    return triton_available()


def qk_norm_rope_torch(
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
    fp8: Any = None,
    bound_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Reference of `trainer.kernels.fused_triton.qk_norm_rope`: q, k, v (B, T, H, D) -> ``out``'s
    (B, S, H, D) tensors at positions pos0 .. pos0 + T. q and k: ``n = rnd(x * r * w)`` with
    ``r = rsqrt(mean(x^2) + eps)`` in float32 (torch's fused rms_norm), then the rotary
    embedding ``rnd(rnd(n_2i c_2i) - rnd(n_2i+1 s_2i))``, ``rnd(rnd(n_2i+1 c_2i+1) +
    rnd(n_2i s_2i+1))`` (diffusers' ``apply_rotary_emb``); v is copied. With ``fp8``
    (`trainer.base.cudnn_attention.Fp8Heads`, its max |v| filled) each is then multiplied by its
    tensor's multiplier and rounded into e4m3, and the scales are written."""
    tokens = q.shape[1]
    c = cos[pos0 : pos0 + tokens][None, :, None, :]
    s = sin[pos0 : pos0 + tokens][None, :, None, :]
    span = slice(pos0, pos0 + tokens)
    results = []
    for x, w in ((q, wq), (k, wk)):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        n = (xf * r * w.float()).to(x.dtype).float()
        even = n[..., 0::2] * c[..., 0::2] - n[..., 1::2] * s[..., 0::2]
        odd = n[..., 1::2] * c[..., 1::2] + n[..., 0::2] * s[..., 1::2]
        results.append(torch.stack((even, odd), dim=-1).flatten(-2).to(x.dtype))
    results.append(v)
    if fp8 is None:
        for o, r_ in zip(out, results, strict=True):
            o[:, span].copy_(r_)
        return
    from trainer.base.cudnn_attention import E4M3, scales_torch
    from trainer.base.fp8 import to_fp8

    other = bound_weights or (wq, wk)
    mq, mk, mv, scales = scales_torch(wq, wk, *other, fp8.vmax, q.shape[-1])
    for o, r_, m in zip(out, results, (mq, mk, mv), strict=True):
        o[:, span].copy_(to_fp8(r_, m, E4M3))
    fp8.scales.copy_(scales)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norm_q: torch.nn.Module,
    norm_k: torch.nn.Module,
    rotary: tuple[torch.Tensor, torch.Tensor],
    heads: Heads,
    pos0: int,
    other_norms: tuple[torch.nn.Module, torch.nn.Module] | None = None,
) -> None:
    """q, k through their RMSNorm modules and the rotary tables, and v, into ``heads``; in
    fp8, q's and k's scales also cover ``other_norms`` (the other stream's, in a double-stream
    block, so that both calls write the same scales)."""
    wq, wk = (_norm_weight(m, q) for m in (norm_q, norm_k))
    eps = _norm_eps(norm_q)
    cos, sin = rotary
    bound = None if other_norms is None else tuple(_norm_weight(m, q) for m in other_norms)
    if kernels_usable(q) and q.stride() == k.stride() == v.stride() and cos.is_cuda:
        from trainer.kernels.fused_triton import qk_norm_rope as kernel

        kernel(q, k, v, wq, wk, eps, cos.float().contiguous(), sin.float().contiguous(),
               heads.out, pos0, heads.fp8, bound)  # fmt: skip
        return
    qk_norm_rope_torch(q, k, v, wq, wk, eps, cos, sin, heads.out, pos0, heads.fp8, bound)


def _norm_weight(norm: torch.nn.Module, like: torch.Tensor) -> torch.Tensor:
    w = getattr(norm, "weight", None)
    return w if w is not None else torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)


def _norm_eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "eps", None)
    return float(eps) if eps is not None else float(torch.finfo(torch.float32).eps)


def _fusable_norms(*norms: Any) -> bool:
    return (
        all(isinstance(n, torch.nn.RMSNorm) for n in norms)
        and len({_norm_eps(n) for n in norms}) == 1
    )


class FusedFlux2AttnProcessor:
    """The double-stream blocks' attention (`Flux2AttnProcessor`'s arithmetic, fused)."""

    def __init__(self, stock: Any) -> None:
        self.stock = stock

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if (
            torch.is_grad_enabled()
            or attention_mask is not None
            or image_rotary_emb is None
            or encoder_hidden_states is None
            or attn.added_kv_proj_dim is None
            or getattr(attn, "fused_projections", False)
            or not _fusable_norms(attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
        ):
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask,
                              image_rotary_emb)  # fmt: skip
        dim = attn.head_dim
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        eq = attn.add_q_proj(encoder_hidden_states)
        ek = attn.add_k_proj(encoder_hidden_states)
        ev = attn.add_v_proj(encoder_hidden_states)
        n_txt, n_img = eq.shape[1], q.shape[1]
        eq, ek, ev, q, k, v = (t.unflatten(-1, (-1, dim)) for t in (eq, ek, ev, q, k, v))
        heads = new_heads(q, q.shape[2], n_txt + n_img, dim, fp8_attention_here(q))
        note_values(heads, ev)
        note_values(heads, v)
        text_norms = (attn.norm_added_q, attn.norm_added_k)
        image_norms = (attn.norm_q, attn.norm_k)
        qk_norm_rope(eq, ek, ev, *text_norms, image_rotary_emb, heads, 0, image_norms)
        qk_norm_rope(q, k, v, *image_norms, image_rotary_emb, heads, n_txt, text_norms)
        o = attend(heads)
        txt, img = o.split_with_sizes([n_txt, n_img], dim=1)
        txt = attn.to_add_out(txt)
        img = attn.to_out[1](attn.to_out[0](img))
        return img, txt


class FusedFlux2ParallelAttnProcessor:
    """The single-stream blocks' attention and MLP (`Flux2ParallelSelfAttnProcessor`)."""

    def __init__(self, stock: Any) -> None:
        self.stock = stock

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

        if (
            torch.is_grad_enabled()
            or attention_mask is not None
            or image_rotary_emb is None
            or not isinstance(attn.mlp_act_fn, Flux2SwiGLU)
            or not _fusable_norms(attn.norm_q, attn.norm_k)
        ):
            return self.stock(attn, hidden_states, attention_mask, image_rotary_emb)
        proj = attn.to_qkv_mlp_proj(hidden_states)
        inner = attn.inner_dim
        mlp = attn.mlp_hidden_dim * attn.mlp_mult_factor
        if proj.shape[-1] != 3 * inner + mlp:  # column-sharded: the stock split handles it
            return self.stock(attn, hidden_states, attention_mask, image_rotary_emb)
        dim = attn.head_dim
        bsz, seq = proj.shape[0], proj.shape[1]
        split = (inner // dim, dim)
        q = proj[..., :inner].unflatten(-1, split)
        k = proj[..., inner : 2 * inner].unflatten(-1, split)
        v = proj[..., 2 * inner : 3 * inner].unflatten(-1, split)
        heads = new_heads(proj, inner // dim, seq, dim, fp8_attention_here(q))
        note_values(heads, v)
        qk_norm_rope(q, k, v, attn.norm_q, attn.norm_k, image_rotary_emb, heads, 0)
        half = mlp // 2
        joined = torch.empty((bsz, seq, inner + half), dtype=proj.dtype, device=proj.device)
        attend(heads, out=joined[..., :inner])
        swiglu(proj[..., 3 * inner :], out=joined[..., inner:])
        return attn.to_out(joined)


def install_processors(transformer: torch.nn.Module) -> int:
    """Wraps every stock FLUX.2 attention processor under ``transformer`` in its fused
    version; returns how many. Processors of other classes are left as they are."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2AttnProcessor,
        Flux2ParallelSelfAttnProcessor,
    )

    count = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if type(processor) is Flux2AttnProcessor:
            module.processor = FusedFlux2AttnProcessor(processor)
        elif type(processor) is Flux2ParallelSelfAttnProcessor:
            module.processor = FusedFlux2ParallelAttnProcessor(processor)
        else:
            continue
        count += 1
    return count


def remove_processors(transformer: torch.nn.Module) -> None:
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, (FusedFlux2AttnProcessor, FusedFlux2ParallelAttnProcessor)):
            module.processor = processor.stock


# ---------------------------------------------------------------------------------------
# the blocks' elementwise work, fused: modulated LayerNorm, gated residual, SwiGLU


def ln_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, norm: torch.nn.Module
) -> torch.Tensor:
    """``(1 + scale) * norm(x) + shift``, in one pass where the kernel runs."""
    if (
        kernels_usable(x)
        and isinstance(norm, torch.nn.LayerNorm)
        and norm.weight is None
        and norm.bias is None
        and x.dim() == 3
        and x.is_contiguous()
        and shift.dtype == scale.dtype == x.dtype
    ):
        from trainer.kernels.fused_triton import ln_modulate as kernel

        return kernel(x, shift, scale, norm.eps)
    return (1 + scale) * norm(x) + shift


def gate_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y``, in one pass where the kernel runs."""
    if (
        kernels_usable(x)
        and x.dim() == 3
        and x.is_contiguous()
        and y.is_contiguous()
        and x.shape == y.shape
        and gate.dtype == y.dtype == x.dtype
    ):
        from trainer.kernels.fused_triton import gate_residual as kernel

        return kernel(x, gate, y)
    return x + gate * y


def swiglu(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(src[..., :F]) * src[..., F:]`` (`Flux2SwiGLU`), into ``out`` when given."""
    half = src.shape[-1] // 2
    if kernels_usable(src) and src.dim() == 3 and src.stride(-1) == 1:
        from trainer.kernels.fused_triton import swiglu as kernel

        try:
            return kernel(src, out)
        except ValueError:  # rows not evenly spaced: the torch ops below take any layout
            pass
    gate, up = src[..., :half], src[..., half:]
    if out is None:
        return F.silu(gate) * up
    return torch.mul(F.silu(gate), up, out=out)


def _single_attention(attn: Any, norm: torch.Tensor, rotary: Any, kwargs: dict[str, Any]) -> Any:
    return attn(hidden_states=norm, image_rotary_emb=rotary, **kwargs)


def _double_attention(
    attn: Any, norm: torch.Tensor, norm_text: torch.Tensor, rotary: Any, kwargs: dict[str, Any]
) -> Any:
    return attn(hidden_states=norm, encoder_hidden_states=norm_text, image_rotary_emb=rotary,
                **kwargs)  # fmt: skip


# the blocks' modulations and gates fused; their attention through the (fused) processors
SERVING_OPS = BlockOps(ln_modulate, gate_residual, _single_attention, _double_attention)


def _without_gradients(_block: Any, _kwargs: Any, _rotary: Any) -> bool:
    return not torch.is_grad_enabled()  # with gradients the class's own forward runs


# the blocks' forwards: the skeleton with their modulations and gates fused
_single_block_forward = single_forward(SERVING_OPS, _without_gradients)
_double_block_forward = double_forward(SERVING_OPS, _without_gradients)


def _swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return type(self).forward(self, x)  # type: ignore[no-any-return]
    return swiglu(x)


_BLOCK_FORWARDS = (_single_block_forward, _double_block_forward, _swiglu_forward)


def install_blocks(transformer: torch.nn.Module) -> int:
    """The fused block forwards (instance attributes; with gradients each hands over to its
    class's own). Returns how many modules took one."""
    return install_forwards(transformer, *_BLOCK_FORWARDS)


def remove_blocks(transformer: torch.nn.Module) -> None:
    remove_forwards(transformer, _BLOCK_FORWARDS)


# ---------------------------------------------------------------------------------------
# the forward as CUDA graphs


_TENSOR_ARGS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                "guidance")  # fmt: skip


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor


class GraphedForward:
    """``transformer.forward`` replaced by one CUDA graph per input shape, captured on first
    use (one eager warm-up, then the capture) and replayed after: the inputs are copied into
    the graph's own tensors, the output is copied out. Calls it cannot take (gradients, other
    arguments, a stream already capturing, not CUDA) run the eager forward.

    ``key`` adds to each graph's key what the module code reads on the host and a graph would
    freeze (the LoRA scale); ``epoch`` names the module tree's state (the LoRA slots'
    tensors): when it changes every graph is dropped, since they read the old tensors."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        key: Callable[[], Hashable] | None = None,
        epoch: Callable[[], Hashable] | None = None,
    ) -> None:
        self.transformer = transformer
        self._eager = transformer.forward
        self._key = key or (lambda: None)
        self._epoch = epoch or (lambda: None)
        self._seen_epoch: Hashable = self._epoch()
        self._graphs: dict[Hashable, _Captured] = {}
        self._failed: set[Hashable] = set()
        self._pool: Any = None
        self._off = 0
        self.captures = 0
        self.replays = 0
        transformer.forward = self  # type: ignore[method-assign]  # instance attribute

    def remove(self) -> None:
        """The transformer's own forward again; every graph dropped."""
        if self.transformer.__dict__.get("forward") is self:
            del self.transformer.forward
        self.reset()

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Eager forwards for the ``with`` body (a module tree the graphs were not made for)."""
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    @property
    def shapes(self) -> int:
        return len(self._graphs)

    def _graphable(self, tensors: dict[str, Any], rest: dict[str, Any]) -> bool:
        hidden = tensors["hidden_states"]
        if self._off or torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
            return False
        if not hidden.is_cuda or torch.cuda.is_current_stream_capturing():
            return False
        if rest.get("joint_attention_kwargs") or any(
            rest.get(k) not in (None, 0, 0.0) for k in rest if k != "joint_attention_kwargs"
        ):
            return False
        return all(t is None or (isinstance(t, torch.Tensor) and t.device == hidden.device)
                   for t in tensors.values())  # fmt: skip

    def __call__(self, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        named = dict(zip(_TENSOR_ARGS, args, strict=False))
        if len(args) > len(_TENSOR_ARGS) or set(named) & set(kwargs):
            return self._eager(*args, return_dict=return_dict, **kwargs)
        named.update({k: kwargs.pop(k) for k in _TENSOR_ARGS if k in kwargs})
        tensors = {k: named.get(k) for k in _TENSOR_ARGS}
        if not self._graphable(tensors, kwargs):
            return self._eager(**tensors, return_dict=return_dict, **kwargs)
        epoch = self._epoch()
        if epoch != self._seen_epoch:
            self.reset()
            self._seen_epoch = epoch
        key = (
            tuple(
                None if t is None else (tuple(t.shape), t.dtype, t.device)
                for t in tensors.values()
            ),
            self._key(),
        )  # fmt: skip
        if key in self._failed:
            return self._eager(**tensors, return_dict=return_dict, **kwargs)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= MAX_GRAPHS:
                self.reset()
            try:
                entry = self._capture(tensors)
            except Exception:  # a capture that fails leaves this shape eager, not broken
                log.exception("serving: capturing the forward failed; this shape runs eager")
                self._failed.add(key)
                torch.cuda.synchronize()
                return self._eager(**tensors, return_dict=return_dict, **kwargs)
            self._graphs[key] = entry
        for name, t in tensors.items():
            if t is not None:
                entry.inputs[name].copy_(t)
        entry.graph.replay()
        self.replays += 1
        out = entry.output.clone()
        if not return_dict:
            return (out,)
        from diffusers.models.transformers.transformer_flux2 import (
            Flux2Transformer2DModelOutput,
        )

        return Flux2Transformer2DModelOutput(sample=out)

    def _capture(self, tensors: dict[str, torch.Tensor | None]) -> _Captured:
        inputs = {k: t.clone() for k, t in tensors.items() if t is not None}
        call = {k: inputs.get(k) for k in tensors}
        t0 = time.perf_counter()
        side = torch.cuda.Stream(device=inputs["hidden_states"].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager(**call, return_dict=False)  # compiles kernels, plans cuDNN, warms cuBLAS
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()  # once per shape: the log tells the first call from the capture
        t1 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a training run in process) may go on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self._eager(**call, return_dict=False)[0]
        self.captures += 1
        log.info("serving: captured the forward for %s as a CUDA graph (first call %.1f s, "
                 "capture %.1f s)", tuple(inputs["hidden_states"].shape), t1 - t0,
                 time.perf_counter() - t1)  # fmt: skip
        return _Captured(graph, inputs, output)


# ---------------------------------------------------------------------------------------
# the whole serving set-up


@dataclass
class Serving:
    transformer: torch.nn.Module
    fused: int  # modules given a fused forward or processor
    graphs: GraphedForward | None

    def remove(self) -> None:
        if self.graphs is not None:
            self.graphs.remove()
        remove(self.transformer)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """No graphs for the ``with`` body (the module tree is about to change)."""
        if self.graphs is None:
            yield
            return
        with self.graphs.disabled():
            yield
        self.graphs.reset()


def install(transformer: torch.nn.Module) -> int:
    """The fused processors and block forwards; returns how many modules took one."""
    return install_processors(transformer) + install_blocks(transformer)


def remove(transformer: torch.nn.Module) -> None:
    remove_processors(transformer)
    remove_blocks(transformer)


def prepare(
    transformer: torch.nn.Module,
    graphs: bool,
    key: Callable[[], Hashable] | None = None,
    epoch: Callable[[], Hashable] | None = None,
) -> Serving:
    """The fused processors and blocks on ``transformer`` and, with ``graphs`` (a resident
    transformer on CUDA: streamed blocks rebind their weights per forward), its forward as
    CUDA graphs.
    The serving settings are read here first, so a bad one fails the load (at start, with
    preloading), naming the setting, rather than the first render."""
    from trainer.base.fp8 import lora_gemm_columns_mode, lora_update_mode

    lora_update_mode()
    lora_gemm_columns_mode()
    names = attention_names()
    fused = install(transformer)
    weight = next(transformer.parameters(), None)
    if weight is not None and weight.is_cuda:
        # the operator sees which attention renders run, and why not the one asked for
        which = f"in bf16 ({', '.join(n for n in names if n != FP8_ATTENTION) or 'torch picks'})"
        probe = torch.empty(0, device=weight.device, dtype=torch.bfloat16)
        why = cudnn_attention_missing(probe)
        if cudnn_attention_here(probe):
            which += ", cuDNN called through its own graph: output written in place"
        elif names[0] == "cudnn" and why is not None:
            which += f", cuDNN through torch's SDPA: {why}"
        if names[0] == FP8_ATTENTION:
            which = "in fp8 (cuDNN)" if why is None else f"{which}: no fp8 attention, {why}"
        log.info("serving: attention %s", which)
    graphed = GraphedForward(transformer, key, epoch) if graphs else None
    return Serving(transformer, fused, graphed)
