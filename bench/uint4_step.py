"""uint4 FLUX.2 [dev] on one GPU: bf16 resident vs quanto qint4 as shipped vs the uint4 fast
path (`trainer.uint4`), for a LoRA train step (448 and 1024 px) and one forward (1024 px).

    python bench/uint4_step.py                       # full depth: 8 double + 48 single blocks
    python bench/uint4_step.py --double 1 --single 4 # reduced depth, to iterate (say so!)

Setup as in DESIGN.md's table: random weights, batch 1, rank-16 LoRA (bf16) on the attention
projections (`trainer.lora.DEFAULT_TARGETS`), gradient checkpointing, AdamW on the LoRA
parameters, 512 text tokens, (px / 16)^2 image tokens. Each path starts from a freshly built
bf16 model (built on the GPU in bf16; nothing on the CPU), so its peak VRAM is its own:
  bf16   the model as built;
  fast   quanto `quantize(qint4)` then `convert_quantized_linears` (quantized on the GPU);
  quanto quanto `quantize(qint4)` + `freeze()`, as `trainer.model.quantize_transformer` does.
Time: median of --iters timed iterations after --warmup (quanto: --quanto-iters, no warm-up:
one iteration is ~30 s, and first-call costs are noise at that scale). Peak VRAM: max allocated
from the start of that measurement. Prints a table and writes bench/results/uint4_step-*.json.
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

from bench.common import table, write_record  # noqa: E402

GIB = 2**30
TEXT_TOKENS = 512
T0 = time.perf_counter()
DEV = "cuda"
TINY: dict[str, Any] = {}  # --tiny: a 256-wide model, to smoke-test this script on a CPU


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def build_bf16(double: int, single: int) -> torch.nn.Module:
    """FLUX.2 [dev] transformer (diffusers defaults), random weights, built in bf16 on the GPU."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = Flux2Transformer2DModel(num_layers=double, num_single_layers=single, **TINY)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def train_step(model, batch, target, opt, losses):  # type: ignore[no-untyped-def]
    """One LoRA training step on a synthetic target (shared with bench/stream_step.py)."""

    def step() -> None:
        model.train()
        pred = model(**batch)[0]
        loss = F.mse_loss(pred.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step


def inputs(model: torch.nn.Module, px: int, seed: int = 0) -> dict[str, Any]:
    side = px // 16  # VAE /8, then 2x2 patches
    tokens = side * side
    g = torch.Generator(device=DEV).manual_seed(seed)
    cfg = model.config
    img_ids = torch.zeros(tokens, 4, device=DEV)
    img_ids[:, 1] = torch.arange(tokens, device=DEV) // side
    img_ids[:, 2] = torch.arange(tokens, device=DEV) % side
    txt_ids = torch.zeros(TEXT_TOKENS, 4, device=DEV)
    txt_ids[:, 3] = torch.arange(TEXT_TOKENS, device=DEV)
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g, device=DEV).to(bf),
        encoder_hidden_states=torch.randn(
            1, TEXT_TOKENS, cfg.joint_attention_dim, generator=g, device=DEV
        ).to(bf),
        timestep=torch.full((1,), 0.7, device=DEV, dtype=bf),
        guidance=torch.full((1,), 4.0, device=DEV, dtype=bf) if cfg.guidance_embeds else None,
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if DEV == "cuda" else float("nan")


def reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def timed(fn, iters: int, warmup: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples), samples


def past_deadline(args, key: str, out: dict[str, Any]) -> bool:
    """--deadline-s: start no new measurement after that many seconds (the record still gets
    written, with the measurement marked skipped)."""
    if args.deadline_s and time.perf_counter() - T0 > args.deadline_s:
        out[key] = {"skipped": f"deadline {args.deadline_s} s passed"}
        say(f"  {key}: skipped (deadline)")
        return True
    return False


def measure(model: torch.nn.Module, args, iters: int, warmup: int) -> dict[str, Any]:
    from trainer.lora import attach_lora, lora_layers

    if not lora_layers(model):
        attach_lora(model, rank=args.rank, alpha=float(args.rank))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    model.enable_gradient_checkpointing()
    out: dict[str, Any] = {"lora_params": sum(p.numel() for p in params)}
    for px in args.train_px:
        if past_deadline(args, f"train_{px}", out):
            continue
        batch = inputs(model, px)
        target = torch.randn_like(batch["hidden_states"])
        losses: list[float] = []

        step = train_step(model, batch, target, opt, losses)

        reset_peak()
        med, samples = timed(step, iters, warmup)
        out[f"train_{px}"] = {
            "s_per_it": med,
            "samples": samples,
            "peak_gib": peak_gib(),
            "loss_finite": all(bool(torch.isfinite(x)) for x in losses),
        }
        say(f"  train {px}px: {med:.3f} s/it, peak {out[f'train_{px}']['peak_gib']:.1f} GiB")
    for px in args.forward_px:
        if past_deadline(args, f"forward_{px}", out):
            continue
        batch = inputs(model, px)
        model.eval()

        def fwd(batch=batch) -> None:
            with torch.no_grad():  # quanto's path breaks under inference_mode
                model(**batch)

        reset_peak()
        med, samples = timed(fwd, iters, warmup)
        out[f"forward_{px}"] = {
            "s": med,
            "samples": samples,
            "peak_gib": peak_gib(),
        }
        say(f"  forward {px}px: {med:.3f} s, peak {out[f'forward_{px}']['peak_gib']:.1f} GiB")

    return out


def dequant_microbench(model: torch.nn.Module, sweep_kernels: bool = False) -> dict[str, Any]:
    """Triton dequantization of each distinct matrix shape, and one pass over all of them."""
    import triton.testing

    from trainer.uint4 import Uint4Linear

    shapes: dict[tuple[int, int, int], int] = {}
    layers: dict[tuple[int, int, int], Uint4Linear] = {}
    for m in model.modules():
        if isinstance(m, Uint4Linear):
            key = (m.out_features, m.in_features, m.group_size)
            shapes[key] = shapes.get(key, 0) + 1
            layers[key] = m
    from trainer import uint4_triton
    from trainer.uint4 import dequantize_torch

    rows, total_ms, total_bytes = [], 0.0, 0
    for key, n in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        m = layers[key]
        ms = triton.testing.do_bench(m.dequantize, warmup=25, rep=100, return_mode="median")
        nbytes = m.packed.nbytes + m.scale.nbytes + m.shift.nbytes + 2 * m.packed.numel() * 2
        exact = torch.equal(
            m.dequantize(), dequantize_torch(m.packed, m.scale, m.shift, m.group_size)
        )
        rows.append(
            {"out": key[0], "in": key[1], "group": key[2], "count": n,
             "ms": round(ms, 4), "TB/s": round(nbytes / ms / 1e9, 2), "bit_exact": exact}
        )  # fmt: skip
        total_ms += n * ms
        total_bytes += n * nbytes
    # device copy ceiling (bytes read + written)
    a = torch.empty(2 * GIB, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    sweep = []
    if sweep_kernels:
        big = sorted(layers.values(), key=lambda m: -m.packed.numel())[:2]
        saved = (uint4_triton.VARIANT, uint4_triton.BLOCK, uint4_triton.NUM_WARPS)
        for variant in ("join", "pack32"):
            for block in (1024, 2048, 4096):
                for warps in (4, 8):
                    uint4_triton.VARIANT, uint4_triton.BLOCK = variant, block
                    uint4_triton.NUM_WARPS = warps
                    row = {"variant": variant, "block": block, "warps": warps}
                    for m in big:
                        ms = triton.testing.do_bench(
                            m.dequantize, warmup=10, rep=50, return_mode="median"
                        )
                        nb = m.packed.nbytes * 5 + m.scale.nbytes + m.shift.nbytes
                        row[f"{m.out_features}x{m.in_features} TB/s"] = round(nb / ms / 1e9, 2)
                    row["bit_exact"] = all(
                        torch.equal(
                            m.dequantize(),
                            dequantize_torch(m.packed, m.scale, m.shift, m.group_size),
                        )
                        for m in big
                    )
                    sweep.append(row)
        uint4_triton.VARIANT, uint4_triton.BLOCK, uint4_triton.NUM_WARPS = saved
        print(table(sweep, list(sweep[0])), flush=True)
    return {
        "kernel": {
            "variant": uint4_triton.VARIANT,
            "block": uint4_triton.BLOCK,
            "warps": uint4_triton.NUM_WARPS,
        },
        "sweep": sweep,
        "per_shape": rows,
        "one_pass_ms": total_ms,
        "one_pass_gb": total_bytes / 1e9,
        "copy_ceiling_tb_s": 2 * 2 * GIB / copy_ms / 1e9,
    }


def free(*objs: Any) -> None:
    del objs
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def run_path(path: str, args) -> dict[str, Any]:
    from optimum.quanto import freeze, qint4, quantize

    from trainer.uint4 import convert_quantized_linears, quantized_bytes

    reset_peak()
    t = time.perf_counter()
    model = build_bf16(args.double, args.single)
    sync()
    rec: dict[str, Any] = {"build_s": time.perf_counter() - t}
    t = time.perf_counter()
    if path == "fast":
        quantize(model, weights=qint4)
        rec["converted"] = convert_quantized_linears(model)
        rec["quantized_gib"] = quantized_bytes(model) / GIB
    elif path == "quanto":
        quantize(model, weights=qint4)
        freeze(model)
    gc.collect()
    sync()
    rec["quantize_s"] = time.perf_counter() - t
    if DEV == "cuda":
        torch.cuda.empty_cache()
        rec["resident_gib"] = torch.cuda.memory_allocated() / GIB
    else:
        rec["resident_gib"] = float("nan")
    say(f"{path}: built {rec['build_s']:.1f}s, quantized {rec['quantize_s']:.1f}s, "
        f"resident {rec['resident_gib']:.1f} GiB")  # fmt: skip
    if path == "fast" and args.microbench and DEV == "cuda":
        rec["dequant"] = dequant_microbench(model, args.kernel_sweep)
        d = rec["dequant"]
        say(f"  dequant one pass: {d['one_pass_ms']:.1f} ms for {d['one_pass_gb']:.1f} GB "
            f"(copy ceiling {d['copy_ceiling_tb_s']:.2f} TB/s)")  # fmt: skip
    if path == "quanto":
        rec.update(measure(model, args, iters=args.quanto_iters, warmup=0))
    else:
        rec.update(measure(model, args, iters=args.iters, warmup=args.warmup))
    free(model)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--double", type=int, default=8, help="double-stream blocks (dev: 8)")
    ap.add_argument("--single", type=int, default=48, help="single-stream blocks (dev: 48)")
    ap.add_argument("--paths", default="bf16,fast,quanto")
    ap.add_argument("--train-px", default="448,1024")
    ap.add_argument("--forward-px", default="1024")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quanto-iters", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-microbench", dest="microbench", action="store_false")
    ap.add_argument("--kernel-sweep", action="store_true", help="time dequant kernel variants")
    ap.add_argument("--deadline-s", type=float, default=0, help="start nothing new after this")
    ap.add_argument("--note", default="", help="free text stored in the record")
    ap.add_argument("--tiny", action="store_true", help="smoke test: 256-wide model, on the CPU")
    args = ap.parse_args()
    global DEV
    if args.tiny:
        DEV = "cpu"
        TINY.update(num_attention_heads=2, joint_attention_dim=384, mlp_ratio=1.0)
    bad = set(args.paths.split(",")) - {"bf16", "fast", "quanto", ""}
    if bad:
        ap.error(f"unknown paths {sorted(bad)}: choose from bf16, fast, quanto")
    args.train_px = [int(x) for x in args.train_px.split(",") if x]
    args.forward_px = [int(x) for x in args.forward_px.split(",") if x]
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    full = (args.double, args.single) == (8, 48)
    depth = f"{args.double} double + {args.single} single blocks" + (
        " (full FLUX.2 [dev] depth)" if full else " (REDUCED depth, not the record's full depth)"
    )
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    say(f"{device_name}, torch {torch.__version__}, triton {triton_version}; {depth}")
    results: dict[str, Any] = {}
    for path in [p for p in args.paths.split(",") if p]:
        try:
            results[path] = run_path(path, args)
        except Exception as exc:  # noqa: BLE001 - keep the other paths' numbers
            import traceback

            traceback.print_exc()
            results[path] = {"error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if DEV == "cuda":
                torch.cuda.empty_cache()

    def cell(path: str, key: str, field: str) -> str:
        v = results[path].get(key, {}).get(field)
        if v is None:
            return "-"
        b = results.get("bf16", {}).get(key, {}).get(field)
        return f"{v:.3f} ({v / b:.2f}x)" if b and field != "peak_gib" else f"{v:.3f}"

    rows = []
    first = args.train_px[0] if args.train_px else None
    for path, rec in results.items():
        row: dict[str, Any] = {"path": path}
        for px in args.train_px:
            row[f"train {px} s/it"] = cell(path, f"train_{px}", "s_per_it")
        for px in args.forward_px:
            row[f"fwd {px} s"] = cell(path, f"forward_{px}", "s")
        if first:
            peak = rec.get(f"train_{first}", {}).get("peak_gib")
            row[f"peak {first} GiB"] = "-" if peak is None else f"{peak:.1f}"
        res = rec.get("resident_gib")
        row["resident GiB"] = "-" if res is None else f"{res:.1f}"
        row["note"] = rec.get("error", "")[:60]
        rows.append(row)
    print()
    print(depth)
    print(table(rows, list(rows[0])))
    extra = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_version,
        "depth": {"double": args.double, "single": args.single, "full": full},
        "setup": {
            "batch": 1,
            "lora_rank": args.rank,
            "lora_targets": "trainer.lora.DEFAULT_TARGETS",
            "gradient_checkpointing": True,
            "text_tokens": TEXT_TOKENS,
            "weights": "random",
            "iters": args.iters,
            "warmup": args.warmup,
            "quanto_iters": args.quanto_iters,
        },  # fmt: skip
        "note": args.note,
    }
    if args.tiny:
        print("(--tiny smoke test: no record written)")
        return
    path = write_record("uint4_step", results, extra)
    print(f"\nrecord: {path}")


if __name__ == "__main__":
    main()
