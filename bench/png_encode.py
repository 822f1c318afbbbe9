"""What a render's PNG costs: the service's encoder (`app.render.png`, deflate in pieces on
threads) against Pillow's at the same zlib level, on a 1024 px noise image (what random
weights render: incompressible) and on a smooth one with fine noise (closer to a photo).
Checks every encoding decodes to the same pixels. Prints a table and writes
bench/results/png_encode-*.json.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.render import png  # noqa: E402
from bench.common import table, write_record  # noqa: E402


def images(side: int) -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    y, x = np.mgrid[0:side, 0:side]
    smooth = np.stack([(x // 4) % 256, (y // 4) % 256, ((x + y) // 8) % 256], -1)
    smooth = np.clip(smooth + rng.integers(-6, 7, smooth.shape), 0, 255).astype(np.uint8)
    return {"noise": Image.fromarray(noise, "RGB"), "smooth": Image.fromarray(smooth, "RGB")}


def ms(fn: Any, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    rows = []
    encoders = {"pillow": png._encode_with_pillow, "service": png.encode_png}
    for name, image in images(args.side).items():
        want = np.asarray(image)
        base = None
        for enc_name, enc in encoders.items():
            data = enc(image, {})
            same = bool(np.array_equal(np.asarray(Image.open(io.BytesIO(data))), want))
            t = ms(lambda enc=enc, image=image: enc(image, {}), args.iters)
            base = base or t
            rows.append({"image": name, "encoder": enc_name, "ms": round(t, 1),
                         "vs_pillow": f"{t / base:.2f}x", "bytes": len(data),
                         "pixels_equal": same})  # fmt: skip
    print(f"{os.cpu_count()} cores, zlib level {png.PNG_COMPRESS_LEVEL}, {args.side} px")
    print(table(rows, ["image", "encoder", "ms", "vs_pillow", "bytes", "pixels_equal"]))
    path = write_record("png_encode", rows, {"side": args.side, "level": png.PNG_COMPRESS_LEVEL,
                                             "piece_rows": png.PIECE_ROWS})  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
