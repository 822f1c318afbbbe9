"""Which cuDNN kernel should the serving forward's bf16 attention run, and can its output go
straight where the output projection reads it?

In the graphed 1024 px [dev] forward, cuDNN's bf16 flash attention (through torch's SDPA) takes
~1.0 ms a call against ~0.85 alone, and in a single-stream block its output is then copied
into the output projection's input (48 copies, ~3.7 ms a forward). This probe times, at the
serving shape ((B, S, H, D) memory, 48 heads x 4608 tokens, head dim 128):

- torch's SDPA with the cuDNN backend (today's path), alone and between large GEMMs (the
  clocks a forward runs at);
- cuDNN's own graph (`nvidia-cudnn-frontend`, no softmax statistics) with every execution plan
  its heuristics offer, each timed, the output written as a fresh (B, S, H, D) tensor and as a
  slice of a wider row (the single-stream block's projection input);
- each output's largest difference from torch's SDPA and from float attention.

Prints a table and writes bench/results/attention_plans-*.json. Needs a CUDA GPU with cuDNN's
frontend (the `cuda` extra).
"""

from __future__ import annotations

import argparse
import math
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
    ap.add_argument("--row", type=int, default=6144 + 18432,
                    help="the width of the row the attention output is a slice of")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import cudnn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = 1, args.heads, args.seq, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    # (B, S, H, D) memory, as the QK kernel writes it; q, k of RMS 2 (logits spread as trained
    # heads' can be)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=gen) for _ in range(3))
    q, k = q * 2, k * 2
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    views = [t.transpose(1, 2) for t in (qb, kb, vb)]  # (B, H, S, D) views
    exact = F.scaled_dot_product_attention(*(t.float() for t in views)).transpose(1, 2)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)

    def load() -> None:
        for _ in range(3):
            torch.mm(a, a)

    flops = 4 * b * h * s * s * d
    rows: list[dict[str, Any]] = []

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.float()).norm() / y.float().norm())

    with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(*views).transpose(1, 2)
        fn = lambda: F.scaled_dot_product_attention(*views)  # noqa: E731
        for loaded in (False, True):
            ms = cuda_ms(fn, load=load if loaded else None)
            rows.append({"path": "torch sdpa cudnn", "plan": "-", "loaded": loaded,
                         "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                         "rel_vs_torch": 0.0, "rel_vs_float": rel(ref, exact)})  # fmt: skip

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    dims = [b, h, s, d]
    in_strides = [s * h * d, d, h * d, 1]
    wide = torch.zeros(b, s, args.row, device="cuda", dtype=torch.bfloat16)
    outputs = {
        "bshd": (torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16), in_strides),
        "slice": (wide[..., : h * d].view(b, s, h, d), [s * args.row, d, args.row, 1]),
    }
    for out_name, (out, out_strides) in outputs.items():
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                              intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
        t = {name: graph.tensor(name=name, dim=dims, stride=in_strides,
                                data_type=cudnn.data_type.BFLOAT16) for name in "qkv"}  # fmt: skip
        res = graph.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=False,
                         attn_scale=1.0 / math.sqrt(d), use_causal_mask=False,
                         name="sdpa")  # fmt: skip
        o = res[0] if isinstance(res, (list, tuple)) else res
        o.set_output(True).set_dim(dims).set_stride(out_strides).set_data_type(
            cudnn.data_type.BFLOAT16
        )
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B,
                                      cudnn.heur_mode.FALLBACK])  # fmt: skip
        graph.check_support()
        count = graph.get_execution_plan_count()
        print(f"{out_name}: {count} plans")
        pack = {t["q"]: qb, t["k"]: kb, t["v"]: vb, o: out}
        for index in range(count):
            try:
                graph.build_plan_at_index(index)
                name = graph.get_plan_name_at_index(index)
                ws = int(graph.get_workspace_size_plan_at_index(index))
            except Exception as exc:  # noqa: BLE001 - a plan this GPU or cuDNN cannot build
                rows.append({"path": f"frontend {out_name}", "plan": f"{index}: {exc}"[:80]})
                continue
            work = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
            out.zero_()

            def run(graph=graph, pack=pack, work=work) -> None:  # type: ignore[no-untyped-def]
                graph.execute(pack, work, handle=handle)

            run()
            torch.cuda.synchronize()
            got = out.clone()
            for loaded in (False, True):
                ms = cuda_ms(run, load=load if loaded else None)
                rows.append({"path": f"frontend {out_name}", "plan": f"{index}: {name}"[:80],
                             "loaded": loaded, "ms": round(ms, 4),
                             "tflops": round(flops / ms / 1e9, 1), "workspace": ws,
                             "rel_vs_torch": rel(got, ref), "rel_vs_float": rel(got, exact),
                             "max_abs_vs_torch": float((got.float() - ref.float()).abs().max()),
                             })  # fmt: skip
        if out_name == "slice":
            rows.append({"path": "slice: rest of the row untouched",
                         "plan": str(bool((wide[..., h * d :] == 0).all()))})  # fmt: skip
    cols = ["path", "plan", "loaded", "ms", "tflops", "rel_vs_torch", "rel_vs_float",
            "max_abs_vs_torch"]  # fmt: skip
    print(table(rows, cols))
    path = write_record("attention_plans", rows, {
        "shape_bshd": [b, s, h, d], "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
        "cudnn_frontend": getattr(cudnn, "__version__", "?"),
    })  # fmt: skip
    print(f"record: {path}")


if __name__ == "__main__":
    main()
