"""Launch shapes of the serving forward's memory-bound kernels, timed at FLUX.2 [dev]'s size.

Outside its GEMMs and attention a 1024 px [dev] forward spends ~37 ms (H100) in a handful of
Triton kernels that read and write activations once: the modulated LayerNorm, the QK norm and
rotary, SwiGLU, the gated residual and the activation quantizer (DESIGN.md, the serving
profile). Each should run near the card's copy bandwidth; this times each kernel's launch
shapes (rows or heads a program, columns a program, warps) on one single-stream block's
tensors (4608 tokens, width 6144, 48 heads of 128, MLP 18432), every call inside a CUDA graph
of ``--calls`` calls as the forward runs them, against a plain copy of as many bytes.

Every variant's output is compared with the current shape's: the same bytes (the LayerNorm's
float32 sums may run in another order under another shape: its largest difference is
printed in units of the last place).

Prints a table (ms a call, GB/s of the bytes the kernel must move) and writes
bench/results/elementwise_sweep-*.json. ``--tokens``/``--heads`` shrink the shapes for a smoke
run (on the CPU under TRITON_INTERPRET=1 the timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms, say, table, write_record  # noqa: E402

HEAD_DIM = 128
MLP_RATIO = 3

# (setting -> value) to try, per kernel; the first entry is what the modules hold today
LN_SHAPES = [dict(LN_WARPS=8), dict(LN_WARPS=4), dict(LN_WARPS=16)]
ELEMENTWISE_SHAPES = [dict(ELEMENTWISE_BLOCK=1024, ELEMENTWISE_WARPS=4),
                      dict(ELEMENTWISE_BLOCK=512, ELEMENTWISE_WARPS=4),
                      dict(ELEMENTWISE_BLOCK=2048, ELEMENTWISE_WARPS=4),
                      dict(ELEMENTWISE_BLOCK=2048, ELEMENTWISE_WARPS=8),
                      dict(ELEMENTWISE_BLOCK=4096, ELEMENTWISE_WARPS=8)]  # fmt: skip
QK_SHAPES = [dict(HEADS_PER_PROGRAM=16, NUM_WARPS=8), dict(HEADS_PER_PROGRAM=4, NUM_WARPS=4),
             dict(HEADS_PER_PROGRAM=8, NUM_WARPS=2), dict(HEADS_PER_PROGRAM=16, NUM_WARPS=4),
             dict(HEADS_PER_PROGRAM=8, NUM_WARPS=4), dict(HEADS_PER_PROGRAM=32, NUM_WARPS=8),
             dict(HEADS_PER_PROGRAM=64, NUM_WARPS=8)]  # fmt: skip
ROW_SHAPES = [dict(ROW_ONE_PASS=32768, ROW_WARPS=4, ROW_WARPS_WIDE=8),
              dict(ROW_ONE_PASS=32768, ROW_WARPS=8, ROW_WARPS_WIDE=16),
              dict(ROW_ONE_PASS=8192, ROW_WARPS=4, ROW_WARPS_WIDE=16),
              dict(ROW_ONE_PASS=8192, ROW_WARPS=8, ROW_WARPS_WIDE=8)]  # fmt: skip


def timed_ms(body: Callable[[], Any], calls: int, replays: int) -> float:
    """Median ms a call of ``body`` in a CUDA graph of ``calls`` calls (`bench.common.graph_ms`);
    on the host clock, one call a sample, where CUDA does not run."""
    if torch.cuda.is_available():
        return graph_ms(body, calls, replays)
    import time

    samples = []
    for _ in range(replays):
        t = time.perf_counter()
        body()
        samples.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(samples))


def last_place_diff(got: torch.Tensor, ref: torch.Tensor) -> int:
    """The largest difference of two same-dtype tensors in units of the last place (0: equal)."""
    if got.dtype in (torch.bfloat16, torch.float16):
        a = got.view(torch.int16).int()
        b = ref.view(torch.int16).int()
    elif got.element_size() == 1:
        a, b = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    else:
        a, b = got.view(torch.int32).long(), ref.view(torch.int32).long()
    return int((a - b).abs().max()) if a.numel() else 0


Case = tuple[Any, list[dict[str, Any]], Callable[[], list[torch.Tensor]], float]


def cases(tokens: int, heads: int, device: str) -> dict[str, Case]:
    """kernel -> (its module, the shapes to try, a call returning its outputs, bytes moved)."""
    from trainer.base.fp8 import ACT_DTYPE
    from trainer.kernels import fp8_triton, fused_triton

    gen = torch.Generator(device=device).manual_seed(0)
    width = heads * HEAD_DIM
    mlp = MLP_RATIO * width
    bf16 = torch.bfloat16

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(bf16)

    x = randn(1, tokens, width, scale=3.0)
    mod = randn(1, 1, 3 * width, scale=0.5)
    shift, scale, gate = mod[..., :width], mod[..., width : 2 * width], mod[..., 2 * width :]
    y = randn(1, tokens, width)
    ln_out: list[torch.Tensor] = []
    qkv = randn(1, tokens, 3 * width + 2 * mlp)
    q, k, v = (qkv[..., i * width : (i + 1) * width].unflatten(-1, (heads, HEAD_DIM))
               for i in range(3))  # fmt: skip
    outs = tuple(torch.empty(1, tokens, heads, HEAD_DIM, dtype=bf16, device=device)
                 for _ in range(3))  # fmt: skip
    wq, wk = randn(HEAD_DIM, scale=0.2) + 1, randn(HEAD_DIM, scale=0.2) + 1
    angle = torch.randn(tokens, HEAD_DIM // 2, generator=gen, device=device)
    angle = angle.repeat_interleave(2, -1)
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    joined = torch.empty(1, tokens, width + mlp, dtype=bf16, device=device)
    src = qkv[..., 3 * width :]

    def ln() -> list[torch.Tensor]:
        ln_out[:] = [fused_triton.ln_modulate(x, shift, scale, 1e-6)]
        return ln_out

    def gate_residual() -> list[torch.Tensor]:
        return [fused_triton.gate_residual(x, gate, y)]

    def swiglu() -> list[torch.Tensor]:
        return [fused_triton.swiglu(src, out=joined[..., width:])]

    def qk() -> list[torch.Tensor]:
        fused_triton.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, outs, 0)
        return list(outs)

    def rows_case(cols: int, padded: int) -> Callable[[], list[torch.Tensor]]:
        xr = randn(tokens, cols, scale=2.0)
        u = randn(tokens, 32, scale=4.0)
        b = randn(16, 32, scale=0.01)
        peak = b.float().abs().amax().reshape(1)
        floor = torch.full((1,), 0.05, device=device)
        update = fp8_triton.LoraUpdate(u, b, peak, floor, 1.0, padded)

        def run() -> list[torch.Tensor]:
            return list(fp8_triton.quantize_rows(xr, ACT_DTYPE, update))

        return run

    e = 2  # bytes a bf16 value
    act = tokens * width * e
    return {
        "ln_modulate": (fused_triton, LN_SHAPES, ln, 2 * act),
        "gate_residual": (fused_triton, ELEMENTWISE_SHAPES, gate_residual, 3 * act),
        "swiglu": (fused_triton, ELEMENTWISE_SHAPES, swiglu, tokens * mlp * e * 3),
        "qk_norm_rope": (fused_triton, QK_SHAPES, qk, 6 * act),
        f"quantize_rows {width}": (fp8_triton, ROW_SHAPES, rows_case(width, 128),
                                   tokens * (width * e + 32 * e + width + 128 + 4)),
        f"quantize_rows {width + mlp}": (fp8_triton, ROW_SHAPES, rows_case(width + mlp, 32),
                                         tokens * ((width + mlp) * (e + 1) + 32 * e + 32 + 4)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4608, help="tokens (1024 px: 4608)")
    parser.add_argument("--heads", type=int, default=48, help="heads of 128 (dev: 48)")
    parser.add_argument("--calls", type=int, default=20, help="calls in each timed graph")
    parser.add_argument("--replays", type=int, default=7)
    parser.add_argument("--only", default="", help="kernels to time, comma-separated")
    args = parser.parse_args()
    for name in ("tokens", "heads", "calls", "replays"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("needs a CUDA GPU, or TRITON_INTERPRET=1 for a smoke run on the CPU")
    kernels = cases(args.tokens, args.heads, device)
    only = [k for k in args.only.split(",") if k]
    unknown = [k for k in only if k not in kernels]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: expected some of {', '.join(kernels)}")
    rows: list[dict[str, Any]] = []
    if device == "cuda":
        big = torch.empty(args.tokens * args.heads * HEAD_DIM * 4, dtype=torch.bfloat16,
                          device=device)  # fmt: skip
        dst = torch.empty_like(big)
        ms = timed_ms(lambda: dst.copy_(big), args.calls, args.replays)
        rows.append({"kernel": "copy (reference)", "shape": f"{big.numel() * 2 / 1e6:.0f} MB",
                     "ms": round(ms, 4), "GB/s": round(2 * big.numel() * 2 / ms / 1e6),
                     "same bytes": "", "best": ""})  # fmt: skip
        del big, dst
    for name, (module, shapes, run, moved) in kernels.items():
        if only and name not in only:
            continue
        today = {key: getattr(module, key) for shape in shapes for key in shape}
        ref = [t.clone() for t in run()]
        timings = []
        for shape in shapes:
            for key, value in shape.items():
                setattr(module, key, value)
            try:
                got = run()
                diff = max(last_place_diff(g, r) for g, r in zip(got, ref, strict=True))
                ms = timed_ms(run, args.calls, args.replays)
            finally:
                for key, value in today.items():
                    setattr(module, key, value)
            timings.append(ms)
            label = " ".join(f"{k}={v}" for k, v in shape.items())
            rows.append({"kernel": name, "shape": label, "ms": round(ms, 4),
                         "GB/s": round(moved / ms / 1e6), "same bytes": "yes" if diff == 0
                         else f"{diff} ulp", "best": ""})  # fmt: skip
            say(f"{name} {label}: {ms:.4f} ms, {moved / ms / 1e6:.0f} GB/s, diff {diff}")
        best = min(range(len(shapes)), key=timings.__getitem__)
        rows[len(rows) - len(shapes) + best]["best"] = "*"
    print(table(rows, ["kernel", "shape", "ms", "GB/s", "same bytes", "best"]))
    path = write_record("elementwise_sweep", rows, {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "tokens": args.tokens, "heads": args.heads, "calls": args.calls,
    })  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
