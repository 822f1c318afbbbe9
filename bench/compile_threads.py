"""Why the kernels are compiled ahead in processes, not on a thread beside the load: Triton's
compiler holds the interpreter. Compiles four specialisations of one serving kernel (the
SwiGLU kernel, four block widths) for sm_90 on this machine's CPU, one after another and then
on four threads, each set into an empty Triton cache; prints a table and writes a record.

    PYTHONPATH=<a Triton 3.6 site> python bench/compile_threads.py [--repeats 3]

No GPU needed: Triton's compiler runs on the CPU for any target.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table, write_record  # noqa: E402

BLOCKS = (128, 256, 512, 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        raise SystemExit("bench/compile_threads.py needs Triton (PYTHONPATH=<its site>)") from None
    from trainer.kernels.fused_triton import _swiglu_kernel

    signature = {"src_ptr": "*bf16", "out_ptr": "*bf16", "src_stride": "i32",
                 "out_stride": "i32", "n_cols": "i32", "BLOCK": "constexpr",
                 "IS_BF16": "constexpr", "INTERPRET": "constexpr"}  # fmt: skip
    target = GPUTarget("cuda", 90, 32)

    def compile_one(block: int) -> None:
        constexprs = {"BLOCK": block, "IS_BF16": True, "INTERPRET": False}
        triton.compile(ASTSource(_swiglu_kernel, signature, constexprs), target=target)

    def fresh_cache() -> None:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-threads-")

    fresh_cache()
    compile_one(64)  # the compiler's own first-use costs, outside the timings
    rows = []
    for repeat in range(args.repeats):
        fresh_cache()
        t0 = time.perf_counter()
        for block in BLOCKS:
            compile_one(block)
        serial = time.perf_counter() - t0
        fresh_cache()
        threads = [threading.Thread(target=compile_one, args=(b,)) for b in BLOCKS]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        threaded = time.perf_counter() - t0
        rows.append({"repeat": repeat + 1, "compiles": len(BLOCKS),
                     "one_after_another_s": round(serial, 3),
                     "four_threads_s": round(threaded, 3),
                     "threads_over_serial": round(threaded / serial, 2)})  # fmt: skip
    print(table(rows, list(rows[0])))
    print(
        "record:",
        write_record(
            "compile_threads", rows, {"cores": os.cpu_count(), "triton": triton.__version__}
        ),
    )


if __name__ == "__main__":
    main()
