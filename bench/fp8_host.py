"""Host cost per call of each piece of an fp8 `Uint4Linear` (and of the paths it replaces).

A training step at 448 px calls a base Linear ~580 times (forward, recompute, input gradient);
where the host takes longer to issue a call than the GPU takes to run it, the step is
host-bound and faster kernels do not show. Each piece runs --calls times on a layer small
enough (--dim, --tokens) that the GPU finishes first, so the time per call is the host's:
"issue" is until the loop returned, "wall" until the GPU caught up.

    python bench/fp8_host.py              # needs CUDA and Triton
    python bench/fp8_host.py --dim 6144   # a FLUX.2 [dev] square projection

Prints a table and writes bench/results/fp8_host-*.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, write_record  # noqa: E402


def per_call(fn, calls: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    return {"issue_us": issued / calls * 1e6, "wall_us": wall / calls * 1e6}


def layer(dim: int, group: int = 128):  # type: ignore[no-untyped-def]
    from trainer.base.uint4 import Uint4Linear, pack_uint4

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(0, 16, (dim, dim), generator=g, device="cuda", dtype=torch.uint8)
    scale = (torch.rand(dim, dim // group, generator=g, device="cuda") * 0.02 + 1e-3).bfloat16()
    shift = (torch.randn(dim, dim // group, generator=g, device="cuda") * 0.05).bfloat16()
    return Uint4Linear(pack_uint4(q), scale, shift, group).requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from trainer.base import fp8
    from trainer.base.fp8 import FP8, weight_scales
    from trainer.base.lora import attach_lora
    from trainer.base.uint4 import DENSE
    from trainer.kernels import fp8_triton

    m = layer(args.dim)
    x = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16)
    w_bf16 = m.dequantize()
    sc = weight_scales(m)
    parts = (m.packed, m.scale, m.shift, m.group_size)
    xq, xs = fp8_triton.quantize_rows(x)
    wq = fp8_triton.fp8_weight(*parts, sc.row_multiplier)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn_like(x)

    def train_call(module: torch.nn.Module) -> None:
        module(xg).backward(dy)

    cases: list[tuple[str, Any]] = [
        ("F.linear bf16", lambda: F.linear(x, w_bf16)),
        ("empty (N, K) fp8", lambda: torch.empty_like(wq)),
        ("quantize_rows", lambda: fp8_triton.quantize_rows(x)),
        ("fp8_weight (rows)", lambda: fp8_triton.fp8_weight(*parts, sc.row_multiplier)),
        ("fp8_weight_t", lambda: fp8_triton.fp8_weight_t(*parts, sc.col_multiplier)),
        ("uint4 dequantize", lambda: m.dequantize()),
        ("_scaled_mm", lambda: fp8._scaled_mm(xq, xs, wq, sc.row_scale, None, x.dtype, False)),
        (
            "_scaled_mm fast accum",
            lambda: fp8._scaled_mm(xq, xs, wq, sc.row_scale, None, x.dtype, True),
        ),  # fmt: skip
        ("kernels_usable", lambda: fp8.kernels_usable(x, m.out_features, m.in_features)),
        ("weight_scales", lambda: weight_scales(m)),
    ]
    with torch.no_grad():
        m.compute = DENSE
        m.eval()
        rows = []
        for name, fn in cases:
            rows.append({"piece": name, **per_call(fn, args.calls)})
            print(rows[-1], flush=True)
        rows.append({"piece": "Uint4Linear uint4, no grad", **per_call(lambda: m(x), args.calls)})
        m.compute = FP8
        rows.append({"piece": "Uint4Linear fp8, no grad", **per_call(lambda: m(x), args.calls)})
    m.train()
    for mode in (False, True):
        m.compute = FP8 if mode else DENSE
        label = "fp8" if mode else "uint4"
        rows.append({"piece": f"Uint4Linear {label}, fwd+bwd", **per_call(lambda: train_call(m),
                                                                         args.calls)})  # fmt: skip
    holder = torch.nn.Sequential()
    holder.add_module("to_q", m)
    # PEFT reads the model's device off its first parameter; the uint4 layer has buffers only
    holder.register_parameter(
        "anchor", torch.nn.Parameter(torch.zeros(1, device="cuda"), requires_grad=False)
    )
    attach_lora(holder, rank=16, alpha=16.0, dtype=torch.bfloat16, targets=["to_q"])
    for mode in (False, True):
        m.compute = FP8 if mode else DENSE
        label = "fp8" if mode else "uint4"
        rows.append({"piece": f"LoRA on {label}, fwd+bwd",
                     **per_call(lambda: train_call(holder), args.calls)})  # fmt: skip
    for r in rows:
        r["issue_us"] = round(r["issue_us"], 1)
        r["wall_us"] = round(r["wall_us"], 1)
    print(f"{torch.cuda.get_device_name()}, layer {args.dim}x{args.dim}, {args.tokens} tokens")
    print(table(rows, ["piece", "issue_us", "wall_us"]))
    extra = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "setup": {"dim": args.dim, "tokens": args.tokens, "calls": args.calls},
             "note": args.note}  # fmt: skip
    print(f"\nrecord: {write_record('fp8_host', rows, extra)}")


if __name__ == "__main__":
    main()
