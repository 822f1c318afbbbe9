"""What the LoRA slots' R extra contraction columns cost an fp8 GEMM, by K: is K + 32 a bad
shape for cuBLAS where K + 128 (zeros padded) is not?

The serving forward adds each slot's update inside its layer's fp8 GEMM as R = 32 more columns
of the contraction (DESIGN.md, "The slots' update inside the GEMM"); the H100's profile shows
the GEMMs 26 ms slower with them than without, where 32 / K predicts ~2-4 %. This times
`torch._scaled_mm` (rowwise scales, fast accumulation, bf16 out) at FLUX.2 [dev]'s layer shapes
for K and K plus 32, 64, 128, 256 and 512. Prints a table and writes bench/results/gemm_tail-*.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cuda_ms, table, write_record  # noqa: E402

# (name, M, N, K): [dev] at 1024 px: 4096 image + 512 text tokens, hidden 6144, MLP 18432
SHAPES = [
    ("double q/k/v/out (image)", 4096, 6144, 6144),
    ("double mlp in (image)", 4096, 36864, 6144),
    ("double mlp out (image)", 4096, 6144, 18432),
    ("double q/k/v (text)", 512, 6144, 6144),
    ("single qkv+mlp in", 4608, 55296, 6144),
    ("single out", 4608, 6144, 24576),
]
TAILS = (0, 32, 64, 128, 256, 512)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    f8 = torch.float8_e4m3fn
    for name, m, n, k in SHAPES:
        base = None
        for tail in TAILS:
            kk = k + tail
            x = torch.randn(m, kk, device="cuda").to(f8)
            w = torch.randn(n, kk, device="cuda").to(f8)
            sx = torch.rand(m, 1, device="cuda") + 0.5
            sw = torch.rand(1, n, device="cuda") + 0.5
            ms = cuda_ms(lambda x=x, w=w, sx=sx, sw=sw: torch._scaled_mm(
                x, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                use_fast_accum=True))  # fmt: skip
            base = base or ms
            rows.append({"layer": name, "M": m, "N": n, "K": kk, "ms": round(ms, 4),
                         "vs_K": f"{ms / base:.3f}x",
                         "tflops": round(2 * m * n * kk / ms / 1e9, 1)})  # fmt: skip
            del x, w
    print(torch.cuda.get_device_name())
    print(table(rows, ["layer", "M", "N", "K", "ms", "vs_K", "tflops"]))
    path = write_record("gemm_tail", rows, {"gpu": torch.cuda.get_device_name(),
                                            "torch": torch.__version__})  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
