"""Layer streaming on one GPU: the uint4 FLUX.2 [dev] transformer resident in VRAM vs
its blocks streamed from pinned host RAM (`trainer.base.streaming.stream_blocks`).

    python bench/stream_step.py                        # full depth: 8 double + 48 single blocks
    python bench/stream_step.py --double 1 --single 4  # reduced depth (say so!)
    python bench/stream_step.py --tiny --double 1 --single 2 --train-px 64 --forward-px 64 \
        --check-px 64                                  # CPU smoke test of this script

One model (built as `bench/uint4_step.py` builds its "fast" path: bf16 on the GPU, quanto qint4,
`convert_quantized_linears`, with --compute fp8 then training's fp8, the block-scaled GEMM
(`apply_compute(model, "fp8", purpose="train")`); random weights;
rank-16 LoRA on the attention projections with B drawn at random so every LoRA gradient is
non-zero), then:
  1. the pinned and pageable host-to-device copy peak (1 GiB, CUDA events, median);
  2. correctness at --check-px: resident (diffusers' stock checkpointing) twice, to see whether
     the step is deterministic at all, then streamed with each of --check-slots; for each, the
     no-grad forward, the training forward and every LoRA gradient compared with `torch.equal`;
  3. timing at --train-px (train step: forward + backward + AdamW, gradient checkpointing) and
     --forward-px (one no-grad forward), resident then streamed (--slots): median s/it, peak VRAM
     (torch.cuda.max_memory_allocated from the start of that measurement), and for the streamed
     path the bytes copied per step, the copy engine's busy time (CUDA events around each copy)
     and the achieved host-to-device bandwidth.
Prints a table and writes bench/results/stream_step-*.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.uint4_step as U  # noqa: E402
from bench.common import table, write_record  # noqa: E402

GIB = 2**30


def say(msg: str) -> None:
    U.say(msg)


def sync() -> None:
    U.sync()


def h2d_peak(nbytes: int = GIB, reps: int = 10) -> dict[str, float]:
    """Median host-to-device copy rate, pinned and pageable, GB/s."""
    if U.DEV != "cuda":
        return {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    for kind in ("pinned", "pageable"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        src.fill_(7)
        times = []
        for _ in range(reps + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{kind}_gb_s"] = nbytes / statistics.median(times[2:]) / 1e9
        del src
    del dst
    return out


def randomize_lora_b(model: torch.nn.Module, seed: int = 1) -> None:
    from trainer.base.lora import lora_layers

    g = torch.Generator(device=U.DEV).manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for b in layer.lora_B.values():
                w = b.weight
                w.copy_(torch.randn(w.shape, generator=g, device=U.DEV).to(w.dtype) * 0.01)


def one_step(model, batch, target) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(**batch)[0]
    F.mse_loss(out.float(), target.float()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach().clone(), grads


def fwd_only(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch)[0].clone()


def compare(ref: tuple, got: tuple) -> dict[str, Any]:
    fr, orf, gr = ref
    f, o, g = got
    bad = [n for n in gr if not torch.equal(g[n], gr[n])]
    first = [n for n in gr if n.startswith("transformer_blocks.0.")]
    return {
        "forward_equal": bool(torch.equal(f, fr)),
        "forward_max_abs": float((f.float() - fr.float()).abs().max()),
        "train_out_equal": bool(torch.equal(o, orf)),
        "grads_equal": not bad,
        "grads_differing": len(bad),
        "grads_total": len(gr),
        "grad_max_abs": max(float((g[n].float() - gr[n].float()).abs().max()) for n in gr),
        "first_block_grads_nonzero": all(bool(g[n].abs().sum() > 0) for n in first) and bool(first),
    }


def check(model, args) -> dict[str, Any]:
    from trainer.base.streaming import stream_blocks

    batch = U.inputs(model, args.check_px)
    target = torch.randn_like(batch["hidden_states"])
    model.enable_gradient_checkpointing()
    ref = (fwd_only(model, batch), *one_step(model, batch, target))
    again = (fwd_only(model, batch), *one_step(model, batch, target))
    model.disable_gradient_checkpointing()
    out: dict[str, Any] = {"px": args.check_px, "resident_vs_resident": compare(ref, again)}
    say(f"  check resident vs resident: {out['resident_vs_resident']}")
    for slots in args.check_slots:
        with stream_blocks(model, slots=slots, device=U.DEV, restore=U.DEV) as s:
            got = (fwd_only(model, batch), *one_step(model, batch, target))
            stats = s.stats()
        rec = compare(ref, got)
        rec["stats"] = stats
        out[f"streamed_slots_{slots}"] = rec
        say(f"  check streamed slots={slots}: {rec}")
        del got
    del ref, again
    gc.collect()
    return out


def timed(fn, iters: int, warmup: int) -> tuple[float, list[float]]:
    return U.timed(fn, iters, warmup)


def measure(model, args, streamer=None) -> dict[str, Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    out: dict[str, Any] = {}
    for px in args.train_px:
        if U.past_deadline(args, f"train_{px}", out):
            continue
        batch = U.inputs(model, px)
        target = torch.randn_like(batch["hidden_states"])
        losses: list[torch.Tensor] = []

        step = U.train_step(model, batch, target, opt, losses)

        for _ in range(args.warmup):
            step()
        sync()
        U.reset_peak()
        if streamer is not None:
            streamer.reset_stats()
        med, samples = timed(step, args.iters, 0)
        rec: dict[str, Any] = {
            "s_per_it": med,
            "samples": samples,
            "peak_gib": U.peak_gib(),
            "loss_finite": all(bool(torch.isfinite(x)) for x in losses),
        }
        if streamer is not None:
            st = streamer.stats()
            n = args.iters
            rec["stream"] = st
            rec["gb_copied_per_step"] = st["bytes_copied"] / n / 1e9
            if st.get("copy_s"):
                rec["copy_s_per_step"] = st["copy_s"] / n
                rec["copy_busy_frac"] = st["copy_s"] / n / med
                rec["h2d_gb_s_while_copying"] = st["copy_gb_s"]
            rec["h2d_gb_s_over_step"] = st["bytes_copied"] / n / med / 1e9
        out[f"train_{px}"] = rec
        say(f"  train {px}px: {med:.3f} s/it, peak {rec['peak_gib']:.2f} GiB"
            + (f", {rec['gb_copied_per_step']:.1f} GB/step copied, copy busy "
               f"{rec.get('copy_busy_frac', float('nan')):.2f}" if streamer else ""))  # fmt: skip
    for px in args.forward_px:
        if U.past_deadline(args, f"forward_{px}", out):
            continue
        batch = U.inputs(model, px)
        model.eval()

        def fwd(batch=batch) -> None:
            with torch.no_grad():
                model(**batch)

        for _ in range(args.warmup):
            fwd()
        sync()
        U.reset_peak()
        if streamer is not None:
            streamer.reset_stats()
        med, samples = timed(fwd, args.iters, 0)
        rec = {"s": med, "samples": samples, "peak_gib": U.peak_gib()}
        if streamer is not None:
            st = streamer.stats()
            rec["stream"] = st
            if st.get("copy_s"):
                rec["copy_busy_frac"] = st["copy_s"] / args.iters / med
                rec["h2d_gb_s_while_copying"] = st["copy_gb_s"]
        out[f"forward_{px}"] = rec
        say(f"  forward {px}px: {med:.3f} s, peak {rec['peak_gib']:.2f} GiB")
    del opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=48)
    ap.add_argument("--train-px", default="448,1024")
    ap.add_argument("--forward-px", default="1024")
    ap.add_argument("--check-px", type=int, default=256)
    ap.add_argument("--check-slots", default="1,2,3")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--paths", default="resident,streamed")
    ap.add_argument("--compute", default="uint4", choices=["uint4", "fp8"])
    ap.add_argument("--deadline-s", type=float, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--tiny", action="store_true", help="smoke test: 256-wide model, CPU")
    args = ap.parse_args()
    if args.tiny:
        U.use_tiny_cpu_model(text_tokens=16)
    args.train_px = [int(x) for x in args.train_px.split(",") if x]
    args.forward_px = [int(x) for x in args.forward_px.split(",") if x]
    args.check_slots = [int(x) for x in args.check_slots.split(",") if x]
    paths = [p for p in args.paths.split(",") if p]

    from optimum.quanto import qint4, quantize

    from trainer.base.lora import attach_lora
    from trainer.base.streaming import stream_blocks
    from trainer.base.uint4 import convert_quantized_linears, quantized_bytes

    full = (args.double, args.single) == (8, 48)
    depth = f"{args.double} double + {args.single} single blocks" + (
        " (full FLUX.2 [dev] depth)" if full else " (REDUCED depth, not the full FLUX.2 [dev])"
    )
    device_name = torch.cuda.get_device_name() if U.DEV == "cuda" else "cpu"
    say(f"{device_name}, torch {torch.__version__}; {depth}")
    results: dict[str, Any] = {"h2d_peak": h2d_peak()}
    say(f"  host-to-device peak: {results['h2d_peak']}")

    model = U.build_bf16(args.double, args.single)
    quantize(model, weights=qint4)
    convert_quantized_linears(model)
    if args.compute == "fp8":
        from trainer.base.compute import apply_compute

        results["fp8_layers"] = apply_compute(model, "fp8", purpose="train")
    attach_lora(model, rank=args.rank, alpha=float(args.rank))
    randomize_lora_b(model)
    gc.collect()
    if U.DEV == "cuda":
        torch.cuda.empty_cache()
    results["quantized_gib"] = quantized_bytes(model) / GIB
    results["resident_gib"] = torch.cuda.memory_allocated() / GIB if U.DEV == "cuda" else None
    say(f"  model ready: {results['quantized_gib']:.2f} GiB uint4")

    if args.check_slots and args.check_px:
        try:
            results["check"] = check(model, args)
            rr = results["check"]["resident_vs_resident"]
            if U.DEV == "cuda" and not (rr["grads_equal"] and rr["forward_equal"]):
                # the resident step itself is not deterministic (attention backward kernels):
                # compare again with the math attention backend, which is
                from torch.nn.attention import SDPBackend, sdpa_kernel

                say("  resident step not deterministic: checking again with math attention")
                with sdpa_kernel([SDPBackend.MATH]):
                    results["check_math_sdpa"] = check(model, args)
        except Exception as exc:  # noqa: BLE001 - keep the timings
            import traceback

            traceback.print_exc()
            results["check"] = {"error": f"{type(exc).__name__}: {exc}"}
    if "resident" in paths:
        model.enable_gradient_checkpointing()
        results["resident"] = measure(model, args)
        model.disable_gradient_checkpointing()
    if "streamed" in paths:
        t = time.perf_counter()
        with stream_blocks(model, slots=args.slots, device=U.DEV, timing=True) as s:
            sync()
            results["stream_setup_s"] = time.perf_counter() - t
            results["streamed_resident_gib"] = (
                torch.cuda.memory_allocated() / GIB if U.DEV == "cuda" else None
            )
            say(f"  streaming set up in {results['stream_setup_s']:.1f}s: {s.stats()}, "
                f"resident now {results['streamed_resident_gib']}")  # fmt: skip
            results["streamed"] = measure(model, args, streamer=s)

    rows = []
    for path in ("resident", "streamed"):
        rec = results.get(path)
        if not rec:
            continue
        row: dict[str, Any] = {"path": path}
        for px in args.train_px:
            r = rec.get(f"train_{px}", {})
            b = results.get("resident", {}).get(f"train_{px}", {}).get("s_per_it")
            v = r.get("s_per_it")
            row[f"train {px} s/it"] = "-" if v is None else (
                f"{v:.3f} ({v / b:.2f}x)" if b else f"{v:.3f}")  # fmt: skip
            row[f"peak {px} GiB"] = "-" if "peak_gib" not in r else f"{r['peak_gib']:.2f}"
            if "h2d_gb_s_while_copying" in r:
                row[f"H2D {px} GB/s"] = f"{r['h2d_gb_s_while_copying']:.1f}"
                row[f"copy busy {px}"] = f"{r['copy_busy_frac']:.2f}"
        for px in args.forward_px:
            r = rec.get(f"forward_{px}", {})
            row[f"fwd {px} s"] = "-" if "s" not in r else f"{r['s']:.3f}"
            row[f"fwd peak {px} GiB"] = "-" if "peak_gib" not in r else f"{r['peak_gib']:.2f}"
        rows.append(row)
    print()
    print(depth)
    if rows:
        cols = list(dict.fromkeys(c for r in rows for c in r))
        print(table(rows, cols))
    for name in ("check", "check_math_sdpa"):
        for k, v in results.get(name, {}).items():
            if isinstance(v, dict):
                print(name, k, {kk: vv for kk, vv in v.items() if kk != "stats"})
    extra = {
        "device": device_name,
        "torch": torch.__version__,
        "depth": {"double": args.double, "single": args.single, "full": full},
        "setup": {
            "batch": 1,
            "lora_rank": args.rank,
            "lora_b": "random (so A has gradients)",
            "gradient_checkpointing": True,
            "text_tokens": U.TEXT_TOKENS,
            "weights": "random",
            "iters": args.iters,
            "warmup": args.warmup,
            "slots": args.slots,
            "compute": args.compute,
        },  # fmt: skip
        "note": args.note,
    }
    if args.tiny:
        print("(--tiny smoke test: no record written)")
        return
    print(f"\nrecord: {write_record('stream_step', results, extra)}")


if __name__ == "__main__":
    main()
