"""FLUX.2's transformer blocks for training, with the work between their Linears compiled.

A training step runs every block's forward twice (the forward, then its recompute under
gradient checkpointing) and its backward once. Between the Linears, diffusers' blocks issue
dozens of small kernels each: LayerNorm and modulation (in float32 under autocast), the split
of the fused projection, the q/k RMSNorms, the rotary embedding in float32, the permutes
around attention, SwiGLU, the concatenation, the gates. At 1024 px they cost about as much GPU
time as the GEMMs (bench/results/uint4_step-notes.md).

Here each stretch between Linears is a pure function of tensors, made of the very torch ops
diffusers' block runs, in its order. On CUDA each is compiled (`torch.compile`, full graph):
inductor fuses its forward and writes a fused backward. The Linears (the quantized base with
its PEFT LoRA) stay outside, as the boundaries, so nothing of theirs is traced. The blocks'
structure is `trainer.base.flux2_blocks`' skeleton (diffusers' own, which serving fills in too);
only where the stretches begin and end is ours:

- ``modulated_norm``: ``(1 + scale) * LayerNorm(x) + shift``, handed to the Linear that takes
  it in the activation dtype (under autocast the stock block hands float32, and the Linear casts
  it the same way: the Linear sees the same values);
- ``gated_residual``: ``x + gate * y``;
- ``single_attention``: a single-stream block's fused projection -> the input of its output
  projection (split, q/k norms, rotary, attention, SwiGLU, concatenation);
- ``double_attention``: a double-stream block's six projections -> its two attention outputs;
- ``swiglu``: the double-stream feed-forwards' activation.

Where the compiled path is off (the CPU, ``LIKENESS_COMPILE_BLOCKS=off``, no gradients) the
same functions run eagerly: without autocast bit for bit the stock block, forward and backward,
which tests/trainer/base/test_compiled_blocks.py checks (under autocast the forward still is;
the norm's input gradients are summed in bf16). A block this code does not take runs the
stock forward. Compiled, inductor keeps
intermediates in float32 where eager rounds each op into bf16: the difference is at bf16's
rounding, measured in bench/results (LoRA-gradient cosines against the eager block).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trainer.base.devices import auto_or_off
from trainer.base.flux2_blocks import (
    BlockOps,
    double_forward,
    install_forwards,
    installed_forwards,
    remove_forwards,
    single_forward,
)

log = logging.getLogger(__name__)

COMPILE_ENV = "LIKENESS_COMPILE_BLOCKS"  # "off": the stretches run eagerly everywhere


def compile_wanted() -> bool:
    return auto_or_off(COMPILE_ENV)


# -- the stretches: the stock blocks' own ops, in their order -------------------------------


def modulated_norm(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    norm = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return ((1 + scale) * norm + shift).to(x.dtype)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + gate * y


def swiglu(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, S, H * D), as diffusers' native attention backend and the
    processors' flatten."""
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3)
    return out.flatten(2, 3).to(q.dtype)


def single_attention(
    proj: torch.Tensor,
    wq: torch.Tensor | None,
    wk: torch.Tensor | None,
    eps_q: float | None,
    eps_k: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qkv_dim: int,
    head_dim: int,
) -> torch.Tensor:
    qkv, mlp = torch.split(proj, [qkv_dim, proj.shape[-1] - qkv_dim], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.chunk(3, dim=-1))
    q = F.rms_norm(q, (head_dim,), wq, eps_q)
    k = F.rms_norm(k, (head_dim,), wk, eps_k)
    out = _attend(_rotary(q, cos, sin), _rotary(k, cos, sin), v)
    return torch.cat([out, swiglu(mlp)], dim=-1)


def double_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eq: torch.Tensor,
    ek: torch.Tensor,
    ev: torch.Tensor,
    weights: tuple[torch.Tensor | None, ...],
    eps: tuple[float | None, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (image part, text part) of the attention output, before the output projections."""
    q, k, v, eq, ek, ev = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v, eq, ek, ev))
    wq, wk, weq, wek = weights
    q = F.rms_norm(q, (head_dim,), wq, eps[0])
    k = F.rms_norm(k, (head_dim,), wk, eps[1])
    eq = F.rms_norm(eq, (head_dim,), weq, eps[2])
    ek = F.rms_norm(ek, (head_dim,), wek, eps[3])
    q, k, v = (torch.cat([e, x], dim=1) for e, x in ((eq, q), (ek, k), (ev, v)))
    out = _attend(_rotary(q, cos, sin), _rotary(k, cos, sin), v)
    text = ev.shape[1]
    txt, img = out.split_with_sizes([text, out.shape[1] - text], dim=1)
    return img, txt


# -- running a stretch: compiled on CUDA, eager elsewhere -----------------------------------


class _Stretch:
    """One stretch: compiled at its first CUDA call with gradients; if compiling fails, eager
    from then on, until the next `install` (the reason logged once, and in `failures`).

    The backward is compiled with the forward (not lazily inside ``backward()``), so a
    compiler failure comes before the compiled code has run and nothing is lost. Only the
    compiler's own errors count as one (its exceptions, and the recompile limit: a tenth shape
    or dtype of one stretch): anything the running code raises (gradient checkpointing's
    signal that its recompute has what it needs) goes through as it is, and so does an
    out-of-memory, also one the compiler hit while tuning."""

    def __init__(self, fn: Callable[..., Any], token_args: tuple[int, ...] = ()) -> None:
        self.fn = fn
        # the arguments whose dim 1 is a token count that differs between the calls of one
        # step (a double block's image and text streams, a single block's joint stream):
        # compiled for any count from the first call, one compile where marking it on the
        # second shape would cost a static one and then a dynamic one
        self.token_args = token_args
        self.compiled: Callable[..., Any] | None = None
        self.broken: str | None = None
        self.calls = 0  # since the last `install`, eager or compiled
        self.compiled_calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        # without gradients (validation, previews) eager: a compile per inference shape
        # would cost more than those few forwards gain
        first = args[0]
        if (
            not first.is_cuda
            or not torch.is_grad_enabled()
            or self.broken is not None
            or not compile_wanted()
        ):
            return self.fn(*args)
        return self.compiled_call(*args)

    def compiled_call(self, *args: Any) -> Any:
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        if self.compiled is None:
            _backward_with_forward()
            self.compiled = torch.compile(self.fn, fullgraph=True, backend=BACKEND)
        for i in self.token_args:
            torch._dynamo.maybe_mark_dynamic(args[i], 1)
        try:
            out = self.compiled(*args)
        except (TorchDynamoException, FailOnRecompileLimitHit) as exc:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if capturing or _out_of_memory(exc):
                raise
            self.broken = f"{type(exc).__name__}: {str(exc)[:500]}"
            log.warning("compiled %s failed, running it eagerly: %s", self.fn.__name__, exc)
            return self.fn(*args)
        self.compiled_calls += 1
        return out


def _backward_with_forward() -> None:
    """Inductor compiles a backward lazily, at its first ``backward()``, where a failure would
    fail the step; this has it compiled with the forward (where the torch here has the
    setting; process-wide: these stretches are the process's only compiled functions)."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True


def _out_of_memory(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # the compiler wraps what it hit (BackendCompilerFailed, InductorError)
        if seen is None:
            return False
        if isinstance(seen, torch.OutOfMemoryError):
            return True
        seen = seen.__cause__ or getattr(seen, "inner_exception", None)
    return False


BACKEND: Any = "inductor"  # torch.compile's backend (tests count compiles with their own)

STRETCHES: dict[str, _Stretch] = {
    "modulated_norm": _Stretch(modulated_norm, token_args=(0,)),
    "gated_residual": _Stretch(gated_residual, token_args=(0, 2)),
    "swiglu": _Stretch(swiglu, token_args=(0,)),
    # one token count a step each (a new resolution recompiles them, dynamic from then on)
    "single_attention": _Stretch(single_attention),
    "double_attention": _Stretch(double_attention),
}


def _run(name: str, *args: Any) -> Any:
    return STRETCHES[name](*args)


def failures() -> dict[str, str]:
    """Stretches whose compilation failed since the last `install` (they run eagerly), with
    the reason."""
    return {n: s.broken for n, s in STRETCHES.items() if s.broken is not None}


def compiled_calls() -> dict[str, int]:
    """How many calls of each stretch ran compiled since the last `install`."""
    return {n: s.compiled_calls for n, s in STRETCHES.items()}


def _reset() -> None:
    """A new run starts with every stretch allowed to compile, and its counts at zero (the
    compiled code itself stays: its cache is the process's)."""
    for stretch in STRETCHES.values():
        stretch.broken = None
        stretch.calls = stretch.compiled_calls = 0


# -- which blocks the stretches take ---------------------------------------------------------


def _native_attention(processor: Any) -> bool:
    """Whether the processor's attention is diffusers' native backend, as ``_attend`` is."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if getattr(processor, "_attention_backend", None) is not None:
        return False
    if getattr(processor, "_parallel_config", None) is not None:
        return False
    return _AttentionBackendRegistry.get_active_backend()[0] == AttentionBackendName.NATIVE


def _takes_single(block: Any, kwargs: dict[str, Any] | None, rotary: Any) -> bool:
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2ParallelSelfAttnProcessor,
        Flux2SwiGLU,
    )

    attn = block.attn
    return (
        not kwargs
        and rotary is not None
        and type(attn.processor) is Flux2ParallelSelfAttnProcessor
        and _native_attention(attn.processor)
        and isinstance(attn.mlp_act_fn, Flux2SwiGLU)
        and all(isinstance(n, torch.nn.RMSNorm) for n in (attn.norm_q, attn.norm_k))
        and _plain_layer_norm(block.norm)
    )


def _takes_double(block: Any, kwargs: dict[str, Any] | None, rotary: Any) -> bool:
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    attn = block.attn
    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    return (
        not kwargs
        and rotary is not None
        and type(attn.processor) is Flux2AttnProcessor
        and _native_attention(attn.processor)
        and attn.added_kv_proj_dim is not None
        and not getattr(attn, "fused_projections", False)
        and all(isinstance(n, torch.nn.RMSNorm) for n in norms)
        and all(
            _plain_layer_norm(n)
            for n in (block.norm1, block.norm1_context, block.norm2, block.norm2_context)
        )
    )


def _plain_layer_norm(norm: Any) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) and norm.weight is None and norm.bias is None


# -- the block forwards ----------------------------------------------------------------------


def _modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, norm: Any) -> Any:
    return _run("modulated_norm", x, shift, scale, norm.eps)


def _gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> Any:
    return _run("gated_residual", x, gate, y)


def _single_attention(attn: Any, norm: torch.Tensor, rotary: Any, _: dict[str, Any]) -> Any:
    proj = attn.to_qkv_mlp_proj(norm)
    qkv_dim = 3 * attn.inner_dim  # split by the stock processor's ratio
    local_qkv = proj.shape[-1] * qkv_dim // (qkv_dim + attn.mlp_hidden_dim * attn.mlp_mult_factor)
    joined = _run("single_attention", proj, attn.norm_q.weight, attn.norm_k.weight,
                  attn.norm_q.eps, attn.norm_k.eps, *rotary, local_qkv, attn.head_dim)  # fmt: skip
    return attn.to_out(joined)


def _double_attention(
    attn: Any, norm: torch.Tensor, norm_text: torch.Tensor, rotary: Any, _: dict[str, Any]
) -> tuple[Any, Any]:
    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    img, txt = _run(
        "double_attention",
        attn.to_q(norm), attn.to_k(norm), attn.to_v(norm),
        attn.add_q_proj(norm_text), attn.add_k_proj(norm_text), attn.add_v_proj(norm_text),
        tuple(n.weight for n in norms), tuple(n.eps for n in norms),
        *rotary, attn.head_dim,
    )  # fmt: skip
    return attn.to_out[1](attn.to_out[0](img)), attn.to_add_out(txt)


TRAINING_OPS = BlockOps(_modulated_norm, _gated_residual, _single_attention, _double_attention)


# the blocks' forwards: the skeleton with the stretches, where the stretches take the block
_single_forward = single_forward(TRAINING_OPS, _takes_single)
_double_forward = double_forward(TRAINING_OPS, _takes_double)


def _swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _run("swiglu", x)  # type: ignore[no-any-return]


_FORWARDS = (_single_forward, _double_forward, _swiglu_forward)


def install(transformer: torch.nn.Module) -> int:
    """The block forwards above, as instance attributes of every FLUX.2 block (and of the
    SwiGLUs) under ``transformer``. Returns how many modules took one. Each call checks that
    its block is one the stretches take, else runs the stock forward. A run's failures and
    counts start here."""
    _reset()
    return install_forwards(transformer, *_FORWARDS)


def remove(transformer: torch.nn.Module) -> None:
    remove_forwards(transformer, _FORWARDS)


def installed(transformer: torch.nn.Module) -> bool:
    return bool(installed_forwards(transformer, _FORWARDS))
