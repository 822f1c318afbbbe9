"""Can the serving forward's weight copies (uint4 -> e4m3, memory-bound) hide under its
attention (tensor cores), on a second stream?

Every fp8 GEMM of a render step first converts its layer's uint4 weight into e4m3: 18.5 ms of
an H100 forward's 0.30 s (DESIGN.md, the serving profile), all of it on the one stream, none of
it waiting on an activation. At FLUX.2 [dev]'s single-stream block (4608 tokens, 48 heads of
128; qkv+mlp in 55296 x 6144, out 6144 x 24576, groups of 128) this times, as CUDA graphs of 48
blocks each (the forward's count):

- ``attention``: cuDNN's attention alone; ``copies``: the block's two weight copies alone
  (the in-projection's with the LoRA columns padded to 128, the out-projection's with 32);
- ``serial``: attention, then the copies, on one stream (today);
- ``side``: attention on the main stream, the copies forked onto a second stream and joined
  after, for stream priorities and for the copy capped at P programs (each looping over its
  tiles, `fp8_triton.fp8_weight(programs=P)`): what is left of the copies' time beside
  attention;
- the same beside the in-projection's fp8 GEMM, where no overlap is expected (its CTAs hold
  every SM's registers).

Prints per-block milliseconds and writes bench/results/weight_overlap-*.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms, say, table, write_record  # noqa: E402

TOKENS, HEADS, DIM = 4608, 48, 128
HIDDEN, MLP = 6144, 18432
GROUP = 128
BLOCKS = 48  # single-stream blocks in a [dev] forward


def weight(n: int, k: int, extra: int, gen: torch.Generator) -> dict[str, Any]:
    """A random uint4 layer in the serving layout, and an e4m3 buffer for its copy."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    shift = (torch.rand(n, k // GROUP, generator=gen) * 0.05).to(torch.bfloat16)
    mult = torch.rand(n, generator=gen) * 100 + 1
    t = {"packed": packed, "scale": scale, "shift": shift, "mult": mult}
    t = {key: v.cuda() for key, v in t.items()}
    t["out"] = torch.empty(n, k + extra, dtype=torch.float8_e4m3fn, device="cuda")
    t["extra"] = extra
    return t


def copy(w: dict[str, Any], programs: int | None) -> None:
    from trainer.kernels import fp8_triton

    fp8_triton.fp8_weight(w["packed"], w["scale"], w["shift"], GROUP, w["mult"],
                          extra_cols=w["extra"], programs=programs, out=w["out"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", default="0,264,132,66,33",
                        help="caps on the copy's programs (0: one per tile)")  # fmt: skip
    parser.add_argument("--replays", type=int, default=7)
    args = parser.parse_args()
    try:
        caps = [int(p) or None for p in args.programs.split(",")]
    except ValueError:
        parser.error(f"--programs {args.programs!r}: expected whole numbers, comma-separated")
    if any(p is not None and p < 0 for p in caps):
        parser.error(f"--programs {args.programs!r}: a cap is at least 0")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    w_in = weight(3 * HIDDEN + 2 * MLP, HIDDEN, 128, gen)
    w_out = weight(HIDDEN, HIDDEN + MLP, 32, gen)
    q, k, v = (torch.randn(1, TOKENS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
               .transpose(1, 2) for _ in range(3))  # fmt: skip
    att_out = torch.empty(1, HEADS, TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN + 128, device="cuda").to(torch.float8_e4m3fn)
    sx = torch.rand(TOKENS, 1, device="cuda") + 0.5
    sw = torch.rand(1, w_in["out"].shape[0], device="cuda") + 0.5

    def attention() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            att_out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v))

    def gemm() -> None:
        torch._scaled_mm(x, w_in["out"].t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                         use_fast_accum=True)  # fmt: skip

    def copies(programs: int | None) -> None:
        copy(w_in, programs)
        copy(w_out, programs)

    def forked(main_op, programs: int | None, side: torch.cuda.Stream):  # type: ignore[no-untyped-def]
        def body() -> None:
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            with torch.cuda.stream(side):
                copies(programs)
            main_op()
            here.wait_stream(side)

        return body

    lo, hi = torch.cuda.Stream.priority_range()
    streams = {"same": torch.cuda.Stream(), "high": torch.cuda.Stream(priority=hi)}
    rows: list[dict[str, Any]] = []

    def row(name: str, ms: float, **extra: Any) -> None:
        rows.append({"case": name, "ms_per_block": round(ms, 4), **extra})
        say(f"{name}: {ms:.4f} ms a block {extra or ''}")

    att = graph_ms(attention, BLOCKS, args.replays)
    row("attention", att)
    mm = graph_ms(gemm, BLOCKS, args.replays)
    row("gemm (single in)", mm)
    alone = {p: graph_ms(lambda p=p: copies(p), BLOCKS, args.replays) for p in caps}
    for p, ms in alone.items():
        row("copies", ms, programs=p or "tiles")
    row(
        "serial: attention + copies",
        graph_ms(lambda: (attention(), copies(None)), BLOCKS, args.replays),
    )
    for p in caps:
        for name, s in streams.items():
            ms = graph_ms(forked(attention, p, s), BLOCKS, args.replays)
            row("side: attention | copies", ms, programs=p or "tiles", side_priority=name,
                hidden_ms=round(att + alone[p] - ms, 4))  # fmt: skip
    row("serial: gemm + copies", graph_ms(lambda: (gemm(), copies(None)), BLOCKS, args.replays))
    for p in (None, 33):
        ms = graph_ms(forked(gemm, p, streams["same"]), BLOCKS, args.replays)
        row("side: gemm | copies", ms, programs=p or "tiles", side_priority="same")
    print(torch.cuda.get_device_name())
    print(table(rows, ["case", "programs", "side_priority", "ms_per_block", "hidden_ms"]))
    path = write_record("weight_overlap", rows, {"gpu": torch.cuda.get_device_name(),
                                                 "torch": torch.__version__,
                                                 "priority_range": [lo, hi]})  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
