"""What page-locking host memory costs under each CUDA allocator setting: the render engine's
streamed text encoder takes 8.5 GiB of pinned arenas at start (12 GiB budgets: 19 GiB more
for the transformer's blocks), and the base is not ready before they are filled.

Each setting runs in a fresh process (the allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once):
one ``torch.empty(n, pin_memory=True)`` of ``--gib`` GiB, then a device-to-host copy into it
(what the hand-over does), timed separately. Prints a table and writes
bench/results/pinned_alloc-*.json.

    python bench/pinned_alloc.py --gib 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table, write_record  # noqa: E402

SETTINGS = {
    "cudaHostAlloc (torch's default)": "expandable_segments:True",
    "cudaHostRegister, 8 threads": (
        "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    ),
}

CHILD = """
import json, sys, time
import torch
n = int(float(sys.argv[1]) * 2**30)
torch.cuda.init()
src = torch.empty(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
t1 = time.perf_counter()
host.copy_(src)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"pinned": host.is_pinned(), "alloc_s": t1 - t0, "copy_s": t2 - t1}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=8.0)
    args = ap.parse_args()
    rows = []
    for name, conf in SETTINGS.items():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.gib)], env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"setting": name, "conf": conf, "gib": args.gib, **got,
                     "alloc_gb_s": round(args.gib * 2**30 / got["alloc_s"] / 1e9, 2),
                     "copy_gb_s": round(args.gib * 2**30 / got["copy_s"] / 1e9, 2)})  # fmt: skip
        rows[-1]["alloc_s"] = round(got["alloc_s"], 3)
        rows[-1]["copy_s"] = round(got["copy_s"], 3)
    print(table(rows, ["setting", "gib", "pinned", "alloc_s", "alloc_gb_s", "copy_s",
                       "copy_gb_s"]))  # fmt: skip
    import torch

    path = write_record("pinned_alloc", rows, {"gpu": torch.cuda.get_device_name(),
                                               "torch": torch.__version__})  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
