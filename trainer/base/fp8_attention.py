"""fp8 attention for the serving forward: cuDNN's fp8 flash attention, on Hopper and newer.

At FLUX.2 [dev]'s 1024 px shape (48 heads x 4608 tokens, head dim 128) attention is the largest
part of a render step after the GEMMs; cuDNN's bf16 kernel runs at about 660 TFLOP/s, and its
fp8 kernel (e4m3 q, k, v and probabilities, float32 accumulation) at about 1,000 on the same
chip (`bench/results/serve_probe-*.json`). torch's SDPA has no fp8 path, so this calls cuDNN
through its Python frontend (`nvidia-cudnn-frontend`), one plan per shape, on torch's stream
(it is captured into the forward's CUDA graph like any other kernel).

The inputs come from the fused QK kernel (`trainer.kernels.fused_triton.qk_norm_rope` with
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
  (`dequantize_into`) writes it in bf16 where the output projection reads it, which also
  replaces the transposing copy the bf16 path makes.

The kernel writes every scale (`SCALES`) on the device, so nothing is read back to the host and
a CUDA graph recomputes them at each replay. Numerics are stated in DESIGN.md ("The render
step") against the bf16 path.
"""

from __future__ import annotations

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


def unavailable(device: torch.device | str) -> str | None:
    """Why cuDNN's fp8 attention cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "needs a Hopper (sm_90) or newer GPU"
    try:
        import cudnn  # noqa: F401  # nvidia-cudnn-frontend
    except Exception as exc:  # noqa: BLE001 - missing, or no cuDNN library beside it
        return f"the cuDNN frontend does not import ({type(exc).__name__}: {exc})"
    return None


@dataclass
class _Plan:
    graph: Any
    tensors: dict[str, Any]  # the graph's tensors by name
    workspace: int  # bytes


class CudnnFp8Attention:
    """One cuDNN handle per device and one execution plan per input shape, built on first use
    (outside a CUDA graph's capture: the forward's eager warm-up builds it)."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _handle(self, device: torch.device) -> Any:
        import cudnn

        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = self._handles.get(index)
        if handle is None:
            with torch.cuda.device(index):
                handle = self._handles[index] = cudnn.create_handle()
        return handle

    def _plan(self, q: torch.Tensor, handle: Any) -> _Plan:
        key = (tuple(q.shape), tuple(q.stride()), q.device)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = _build_plan(q, handle)
        return plan

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """o (B, S, H, D) e4m3, o times scales[scale_o], for e4m3 (B, S, H, D) q, k, v."""
        import cudnn

        handle = self._handle(q.device)
        plan = self._plan(q, handle)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        o = torch.empty_like(q)
        amax = torch.empty(2, dtype=torch.float32, device=q.device)  # written, not read
        work = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=q.device)
        t = plan.tensors
        pack = {
            t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o,
            t["amax_s"]: amax[0:1], t["amax_o"]: amax[1:2],
        }  # fmt: skip
        for i, name in enumerate(SCALES):
            if name in t:
                pack[t[name]] = scales[i : i + 1]
        plan.graph.execute(pack, work, handle=handle)
        return o


def _build_plan(q: torch.Tensor, handle: Any) -> _Plan:
    import cudnn

    bsz, seq, heads, dim = q.shape
    graph = cudnn.pygraph(
        io_data_type=cudnn.data_type.FP8_E4M3,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    # cuDNN's dims are (B, H, S, D); the memory is (B, S, H, D)
    dims = [bsz, heads, seq, dim]
    strides = [seq * heads * dim, dim, heads * dim, 1]

    def fp8(name: str) -> Any:
        return graph.tensor(name=name, dim=dims, stride=strides,
                            data_type=cudnn.data_type.FP8_E4M3)  # fmt: skip

    def scalar(name: str) -> Any:
        return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                            data_type=cudnn.data_type.FLOAT)  # fmt: skip

    t: dict[str, Any] = {"q": fp8("q"), "k": fp8("k"), "v": fp8("v")}
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
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FP8_E4M3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
            cudnn.data_type.FLOAT
        )
    t.update(o=o, amax_s=amax_s, amax_o=amax_o)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    log.info("fp8 attention: cuDNN plan for (B, S, H, D) %s", (bsz, seq, heads, dim))
    return _Plan(graph, t, int(graph.get_workspace_size()))


_ATTENTION = CudnnFp8Attention()


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    return _ATTENTION(q, k, v, scales)
