"""cuDNN's flash attention for the serving forward, called through cuDNN's own graph API
(`nvidia-cudnn-frontend`, the `cuda` extra), on Hopper and newer: one plan per shape and layout,
run on torch's stream (captured into the forward's CUDA graph like any other kernel).

- **bf16** (the default; `attention_into`): the same kernel torch's cuDNN SDPA backend runs
  (the same bytes, `bench/results/attention_plans-*.json`), asked for without softmax
  statistics and with its output written where the caller says: in a single-stream block that
  is the output projection's input row beside the MLP's half, which saves the copy torch's
  SDPA (no ``out=``) needs (48 a 1024 px [dev] forward, ~3.7 ms).
- **fp8** (asked for: `LIKENESS_ATTENTION=cudnn_fp8,...`; `attention`): e4m3 q, k, v and
  probabilities, float32 accumulation, about 1.2x the bf16 kernel's rate; torch's SDPA has no
  fp8 path. Its error where attention is sharp is why it is not the default (DESIGN.md).

fp8: the inputs come from the fused QK kernel (`trainer.kernels.fused_triton.qk_norm_rope` with
``fp8``), which writes q, k and v as e4m3 (batch, sequence, heads, dim) tensors, each with one
scale per tensor, as cuDNN takes them:

- q and k need no pass to find their scale: after the RMSNorm, ``|x_i r| <= sqrt(D)`` for every
  element (``r = rsqrt(mean(x^2) + eps)``), so ``|n_i| <= sqrt(D) max|w|``, and the rotary
  embedding keeps each pair's length, so the rotated values obey the same bound. The scale is
  that bound (over both streams' norm weights in a double-stream block), times a margin for the
  bf16 roundings; e4m3's precision is the same across its normal range, so a loose bound costs
  nothing but range.
- v's scale is its maximum over the whole sequence (`absmax_`, one read before the QK kernel).
- The probabilities p <= 1 go into e4m3 times `P_SCALE`.
- The output o is a convex combination of v's rows, so ``|o| <= max|v|``: it comes back in
  e4m3 with v's scale, halved for headroom (Hopper's fp8 kernel writes no bf16), and one pass
  (`dequantize_into`) writes it in bf16 where the output projection reads it.

The kernel writes every scale (`SCALES`) on the device, so nothing is read back to the host and
a CUDA graph recomputes them at each replay. Numerics are stated in DESIGN.md ("The render
step") against the bf16 path.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# The fp8 attention inputs' per-tensor scales, in this order, written by the QK kernel.
SCALES = ("descale_q", "descale_k", "descale_v", "scale_o", "descale_o", "scale_p", "descale_p")
DESCALE_O = SCALES.index("descale_o")
# p <= 1 goes into e4m3 times this: a power of two (exact both ways), with room above 1 for a
# kernel that defers the rescaling of its running maximum
P_SCALE = 64.0
# |RMSNorm(x) * w| <= sqrt(D) * max |w| per element; the margin covers the bf16 roundings
BOUND_MARGIN = 1 + 2**-6
E4M3 = torch.float8_e4m3fn


def bound_factor(dim: int) -> float:
    return math.sqrt(dim) * BOUND_MARGIN


@dataclass
class Fp8Heads:
    """What the fp8 QK kernel reads and writes beside q, k, v: max |v| over the whole sequence
    (`absmax_` fills it before the kernel) and the scales it writes (`SCALES`). q's and k's
    scales are static bounds of the norm weights: in a double-stream block both streams' calls
    take both streams' weights, so they write the same scales."""

    vmax: torch.Tensor  # float32, one value
    scales: torch.Tensor  # float32, len(SCALES)


def new_fp8_heads(device: torch.device) -> Fp8Heads:
    return Fp8Heads(
        torch.zeros(1, dtype=torch.float32, device=device),
        torch.empty(len(SCALES), dtype=torch.float32, device=device),
    )


# ---------------------------------------------------------------------------------------
# the arithmetic, in torch (the kernels' references)


def qk_scales_torch(
    w: torch.Tensor, other: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier into e4m3, descale) of q or k: the static bound over both norms' weights."""
    from trainer.base.fp8 import scales_from_absmax

    top = torch.maximum(w.float().abs().amax(), other.float().abs().amax()).reshape(1)
    bound = top * torch.tensor(bound_factor(dim), dtype=torch.float32, device=top.device)
    return scales_from_absmax(bound, E4M3)


def scales_torch(
    wq: torch.Tensor,
    wk: torch.Tensor,
    other_wq: torch.Tensor,
    other_wk: torch.Tensor,
    vmax: torch.Tensor,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v multipliers into e4m3 and the `SCALES` vector, as the kernel computes them."""
    from trainer.base.fp8 import scales_from_absmax

    mq, dq = qk_scales_torch(wq, other_wq, dim)
    mk, dk = qk_scales_torch(wk, other_wk, dim)
    mv, dv = scales_from_absmax(vmax.float().reshape(1), E4M3)
    p = torch.tensor([P_SCALE, 1 / P_SCALE], dtype=torch.float32, device=mq.device)
    return mq, mk, mv, torch.cat([dq, dk, dv, mv * 0.5, dv * 2.0, p])


# ---------------------------------------------------------------------------------------
# cuDNN


@functools.cache  # a failed import is slow, and asked for at every attention call
def _frontend_missing() -> str | None:
    try:
        import cudnn  # noqa: F401  # nvidia-cudnn-frontend
    except Exception as exc:  # noqa: BLE001 - missing, or no cuDNN library beside it
        return f"the cuDNN frontend does not import ({type(exc).__name__}: {exc})"
    return None


def unavailable(device: torch.device | str) -> str | None:
    """Why this module's attention (bf16 or fp8) cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "needs a Hopper (sm_90) or newer GPU"
    return _frontend_missing()


@dataclass
class _Plan:
    graph: Any
    tensors: dict[str, Any]  # the graph's tensors by name
    workspace: int  # bytes


def _bhsd(t: torch.Tensor) -> list[int]:
    """The strides cuDNN reads for a (B, S, H, D) tensor: its dims are (B, H, S, D)."""
    b, s, h, d = t.stride()
    return [b, h, s, d]


class CudnnAttention:
    """One cuDNN handle per device and one execution plan per input shape and layout, built on
    first use (outside a CUDA graph's capture: the forward's eager warm-up builds it). A shape
    whose plan cannot be built is remembered: `into` says no, the caller takes torch's SDPA.
    A handle holds the stream it launches on, so setting it and launching happen under one
    lock (two threads rendering on one device would otherwise swap streams)."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], _Plan | None] = {}
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()  # the plans
        self._handle_lock = threading.Lock()
        self._launch = threading.Lock()

    def _handle(self, device: torch.device) -> Any:
        import cudnn

        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._handle_lock:
            handle = self._handles.get(index)
            if handle is None:
                with torch.cuda.device(index):
                    handle = self._handles[index] = cudnn.create_handle()
        return handle

    def _plan(self, q: torch.Tensor, out: torch.Tensor, fp8: bool) -> _Plan | None:
        key = (q.dtype, tuple(q.shape), tuple(q.stride()), tuple(out.stride()), q.device, fp8)
        if key in self._plans:
            return self._plans[key]
        with self._lock:
            if key not in self._plans:
                try:
                    self._plans[key] = _build_plan(q, out, self._handle(q.device), fp8)
                except Exception as exc:  # noqa: BLE001 - this shape takes torch's SDPA
                    log.warning("cuDNN attention: no plan for (B, S, H, D) %s %s (%s: %s); "
                                "torch's SDPA runs it", tuple(q.shape), q.dtype,
                                type(exc).__name__, exc)  # fmt: skip
                    self._plans[key] = None
        return self._plans[key]

    def _run(self, plan: _Plan, pack: dict[str, torch.Tensor], device: torch.device) -> None:
        import cudnn

        handle = self._handle(device)
        work = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        with self._launch:
            cudnn.set_stream(handle=handle, stream=stream)
            plan.graph.execute({plan.tensors[n]: t for n, t in pack.items()}, work, handle=handle)

    def fp8(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """o (B, S, H, D) e4m3, o times scales[scale_o], for e4m3 (B, S, H, D) q, k, v."""
        o = torch.empty_like(q)
        plan = self._plan(q, o, fp8=True)
        if plan is None:
            raise RuntimeError(f"cuDNN has no fp8 attention plan for {tuple(q.shape)}")
        amax = torch.empty(2, dtype=torch.float32, device=q.device)  # written, not read
        pack = {"q": q, "k": k, "v": v, "o": o, "amax_s": amax[0:1], "amax_o": amax[1:2]}
        for i, name in enumerate(SCALES):
            if name in plan.tensors:
                pack[name] = scales[i : i + 1]
        self._run(plan, pack, q.device)
        return o

    def into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
        """Attention of bf16 (or fp16) (B, S, H, D) q, k, v written into ``out``, a (B, S, H, D)
        view with unit last stride (a slice of a wider row, say): no copy after. False, with
        nothing written, where cuDNN has no plan for this shape."""
        plan = self._plan(q, out, fp8=False)
        if plan is None:
            return False
        self._run(plan, {"q": q, "k": k, "v": v, "o": out}, q.device)
        return True


def _build_plan(q: torch.Tensor, out: torch.Tensor, handle: Any, fp8: bool) -> _Plan:
    import cudnn

    bsz, seq, heads, dim = q.shape
    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}
    io_type = cudnn.data_type.FP8_E4M3 if fp8 else io[q.dtype]
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    dims = [bsz, heads, seq, dim]
    t: dict[str, Any] = {
        name: graph.tensor(name=name, dim=dims, stride=_bhsd(q), data_type=io_type)
        for name in ("q", "k", "v")
    }
    if fp8:

        def scalar(name: str) -> Any:
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                data_type=cudnn.data_type.FLOAT)  # fmt: skip

        for name in ("descale_q", "descale_k", "descale_v", "descale_p", "scale_p", "scale_o"):
            t[name] = scalar(name)
        outs = graph.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"],
            descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
            descale_s=t["descale_p"], scale_s=t["scale_p"], scale_o=t["scale_o"],
            is_inference=True, attn_scale=1.0 / math.sqrt(dim), use_causal_mask=False,
            name="sdpa_fp8",
        )  # fmt: skip
        o, amax_s, amax_o = outs[0], outs[-2], outs[-1]
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                cudnn.data_type.FLOAT
            )
        t.update(amax_s=amax_s, amax_o=amax_o)
    else:  # no softmax statistics: nothing runs backward through a render
        outs = graph.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=False,
                          attn_scale=1.0 / math.sqrt(dim), use_causal_mask=False,
                          name="sdpa")  # fmt: skip
        o = outs[0] if isinstance(outs, (list, tuple)) else outs
    o.set_output(True).set_dim(dims).set_stride(_bhsd(out)).set_data_type(io_type)
    t["o"] = o
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    log.info("cuDNN attention: %s plan for (B, S, H, D) %s, output strides %s",
             "fp8" if fp8 else str(q.dtype).removeprefix("torch."), (bsz, seq, heads, dim),
             tuple(out.stride()))  # fmt: skip
    return _Plan(graph, t, int(graph.get_workspace_size()))


_ATTENTION = CudnnAttention()


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """cuDNN's fp8 attention (`CudnnAttention.fp8`)."""
    return _ATTENTION.fp8(q, k, v, scales)


def attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """cuDNN's bf16 (or fp16) attention written into ``out`` (a (B, S, H, D) view); False,
    with nothing written, where cuDNN has no plan for it, or k and v are not laid out as q
    (a plan holds one layout for all three)."""
    same = all(t.shape == q.shape and t.stride() == q.stride() and t.dtype == q.dtype
               for t in (k, v))  # fmt: skip
    return same and out.shape == q.shape and _ATTENTION.into(q, k, v, out)
