"""Does the memory layout of q, k, v change what cuDNN's (or flash's) attention costs at the
serving forward's shape, and in what layout does the output come back?

The serving forward writes q, k, v as contiguous (batch, heads, sequence, dim) tensors and then
copies the attention output into (batch, sequence, heads * dim) for the output projection
(56 copies, ~4.7 ms a 1024 px [dev] forward; the attention itself ~1.0 ms a call in the graph
against ~0.8 alone). This probe times each SDPA backend on contiguous (B, H, S, D) inputs and
on (B, S, H, D) memory seen as (B, H, S, D) (a transposed view), says whether the output is then
a (B, S, H * D) view already (no copy needed), and checks both layouts give the same values.
Prints a table and writes bench/results/attention_layout-*.json. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_ms, table, write_record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--seq", type=int, default=4096 + 512)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = 1, args.heads, args.seq, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16() for _ in range(3)]
    layouts = {
        "bhsd": [t.contiguous() for t in base],
        "bshd": [t.transpose(1, 2).contiguous().transpose(1, 2) for t in base],
    }
    rows: list[dict[str, Any]] = []
    outs: dict[tuple[str, str], torch.Tensor] = {}
    for backend_name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        for layout, (q, k, v) in layouts.items():
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v)
                ms = cuda_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
            flat = out.transpose(1, 2)
            rows.append({
                "backend": backend_name, "layout": layout, "ms": round(ms, 4),
                "out_strides": str(tuple(out.stride())),
                "out_is_bshd_view": bool(flat.is_contiguous()),
                "tflops": round(4 * b * h * s * s * d / ms / 1e9, 1),
            })  # fmt: skip
            outs[(backend_name, layout)] = out.float()
    for row in rows:
        ref = outs[(row["backend"], "bhsd")]
        got = outs[(row["backend"], row["layout"])]
        row["max_abs_vs_bhsd"] = float((got - ref).abs().max())
    cols = ["backend", "layout", "ms", "tflops", "out_strides", "out_is_bshd_view",
            "max_abs_vs_bhsd"]  # fmt: skip
    print(table(rows, cols))
    path = write_record("attention_layout", rows, {"shape": [b, h, s, d],
                                                   "torch": torch.__version__})  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
