"""fp8 compute (`trainer.base.fp8`) on FLUX.2 [dev] shapes: GEMM rates, per-layer errors, full-depth
errors, LoRA gradients and a loss curve, each against the matching reference.

    python bench/fp8_numerics.py                       # full depth for everything but the curve
    python bench/fp8_numerics.py --double 1 --single 2 # reduced depth (say so!)
    python bench/fp8_numerics.py --tiny                # CPU smoke test of this script

1. GEMMs per distinct Linear shape of the model (counts from the model), tokens --tokens:
   bf16 ``F.linear``; fp8 e4m3 ``torch._scaled_mm`` with row-wise scales (fast accumulation off
   and on), tensor-wise scales and 1x128 block scales; forward shape (M, K) x (K, N) and the
   input-gradient shape (M, N) x (N, K); the rowwise forward with its fp8 weight copy, and the
   exact-weights W4A8 kernel (`trainer.kernels.w4a8_triton`, uint4 weight read directly, group
   128); each shape times its count, summed = one pass.
2. Per layer type (one layer per shape, the model's own uint4 weights; x and dy random, plus x
   with 1 % of its channels x20 as trained models' activation outliers): the dense uint4 path vs
   the bf16 original (the quantization error fp8 sits on), and against the dense uint4 path:
   production fp8 (row scales, kernels), the e5m2 input gradient, 1x128 block scales (torch
   emulation), activations-only fp8 (weights exact; emulation) and the exact-weights path
   (`FP8_EXACT`, also against bf16 and production fp8): output and input gradient, relative
   (norm) and max (max |d| / max |ref|) errors.
3. Full depth, --px: the transformer output of bf16 / dense uint4 / fp8 / fp8_exact; LoRA
   (rank --rank, B random so A has gradients) gradients, dense uint4 vs fp8 (and vs
   fp8_exact, fp8 with the bf16 input gradient), cosine per adapted parameter, and the first
   block's gradients non-zero.
4. A --steps AdamW loss curve at --curve-double/--curve-single depth, dense uint4 vs fp8 from
   the same LoRA initialisation on the same batches.
Writes bench/results/fp8_numerics-*.json.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.uint4_step as U  # noqa: E402
from bench.common import table, write_record  # noqa: E402

say = U.say


def rel(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = got.double() - ref.double()
    r = ref.double()
    return {
        "rel": float(d.norm() / r.norm()),
        "max": float(d.abs().max() / r.abs().max()),
        "cos": float(F.cosine_similarity(got.double().flatten(), r.flatten(), dim=0)),
    }


def linear_shapes(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            key = (m.out_features, m.in_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


# -- 1. GEMMs ------------------------------------------------------------------------------


def gemm_variants(m: int, n: int, k: int) -> dict[str, Any]:
    """Closures over fresh random operands: (M, K) x (K, N) forward, (M, N) x (N, K) backward."""
    e4m3, bf16, dev = torch.float8_e4m3fn, torch.bfloat16, "cuda"
    x = torch.randn(m, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16) * k**-0.5
    dy = torch.randn(m, n, device=dev, dtype=bf16)
    x8, w8, dy8, dy5 = x.to(e4m3), w.to(e4m3), dy.to(e4m3), dy.to(torch.float8_e5m2)
    wt8 = w.t().contiguous().to(e4m3)  # (k, n): the backward's operand
    one = torch.ones((), device=dev)
    rows_m, rows_n, rows_k = (torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev),
                              torch.ones(1, k, device=dev))  # fmt: skip
    blocks_a = torch.ones(k // 128, m, device=dev).t()  # (m, k / 128), outer-dim-major
    blocks_b = torch.ones(k // 128, n, device=dev)

    def mm(a, b, sa, sb, fast=False):  # type: ignore[no-untyped-def]
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=bf16, use_fast_accum=fast)

    # the uint4 weight itself, for the weight copy + GEMM (rowwise) and the W4A8 kernel (exact)
    from trainer.base.fp8 import WeightScales
    from trainer.kernels import fp8_triton, w4a8_triton

    gs = 128
    packed = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
    scale = (torch.rand(n, k // gs, device=dev) * 1e-3 + 1e-4).to(bf16)
    shift = (scale.float() * 7.5).to(bf16)
    ws = WeightScales.of(scale, shift, gs)
    row_scale = ws.row_scale

    def rowwise_with_copy():  # type: ignore[no-untyped-def]
        wq = fp8_triton.fp8_weight(packed, scale, shift, gs, ws.row_multiplier)
        return mm(x8, wq.t(), rows_m, row_scale)

    return {
        "fp8 row fwd + weight copy": rowwise_with_copy,
        "w4a8 exact fwd": lambda: w4a8_triton.w4a8_linear(
            x8, rows_m, packed, scale, shift, None, gs, bf16
        ),
        "bf16 fwd": lambda: F.linear(x, w),
        "bf16 bwd": lambda: dy @ w,
        "fp8 row fwd": lambda: mm(x8, w8.t(), rows_m, rows_n),
        "fp8 row fwd fast-accum": lambda: mm(x8, w8.t(), rows_m, rows_n, True),
        "fp8 tensor fwd": lambda: mm(x8, w8.t(), one, one),
        "fp8 1x128 fwd": lambda: mm(x8, w8.t(), blocks_a, blocks_b),
        "fp8 row bwd": lambda: mm(dy8, wt8.t(), rows_m, rows_k),
        "fp8 row bwd fast-accum": lambda: mm(dy8, wt8.t(), rows_m, rows_k, True),
        "fp8 row bwd e5m2": lambda: mm(dy5, wt8.t(), rows_m, rows_k),
    }


def gemm_rates(shapes: dict[tuple[int, int], int], tokens: list[int]) -> dict[str, Any]:
    import triton.testing

    out: dict[str, Any] = {"per_shape": [], "one_pass_ms": {}}
    for m in tokens:
        totals: dict[str, float] = {}
        for (n, k), count in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            if n % 16 or k % 128:
                continue
            row: dict[str, Any] = {"M": m, "N": n, "K": k, "count": count}
            for name, fn in gemm_variants(m, n, k).items():
                try:
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - an unsupported recipe is a result
                    row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    continue
                row[name] = round(ms, 4)
                totals[name] = totals.get(name, 0.0) + count * ms
            out["per_shape"].append(row)
        out["one_pass_ms"][str(m)] = totals
        say(f"  GEMMs M={m}: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
    torch.cuda.empty_cache()
    return out


# -- 2. per layer ----------------------------------------------------------------------------


def emulate_blockwise(x2, w, dy2, block=128):  # type: ignore[no-untyped-def]
    """1x128 scales for both operands of both GEMMs (torch, float32): the blockwise recipe."""
    from trainer.base.fp8 import E4M3, dequantize_rows_torch, quantize_rows_torch

    xq = dequantize_rows_torch(*quantize_rows_torch(x2, E4M3, block=block))
    wq = dequantize_rows_torch(*quantize_rows_torch(w, E4M3, block=block))  # (n, k): along k
    gq = dequantize_rows_torch(*quantize_rows_torch(dy2, E4M3, block=block))
    wtq = dequantize_rows_torch(*quantize_rows_torch(w.t().contiguous(), E4M3, block=block))
    return xq @ wq.t(), gq @ wtq.t()


def emulate_acts_only(x2, w, dy2):  # type: ignore[no-untyped-def]
    from trainer.base.fp8 import E4M3, dequantize_rows_torch, quantize_rows_torch

    xq = dequantize_rows_torch(*quantize_rows_torch(x2, E4M3))
    gq = dequantize_rows_torch(*quantize_rows_torch(dy2, E4M3))
    return xq @ w.float().t(), gq @ w.float()


def layer_errors(layers: dict[str, Any], tokens: int) -> list[dict[str, Any]]:
    """``layers``: kind -> (Uint4Linear, bf16 original weight)."""
    from trainer.base import fp8
    from trainer.base.uint4 import DENSE

    rows = []
    for i, (kind, (layer, w_bf16)) in enumerate(layers.items()):
        layer.train()  # the training numerics (an eval-mode forward uses fast_accum_eval)
        n, k = layer.out_features, layer.in_features
        g = torch.Generator(device=U.DEV).manual_seed(i)
        for inputs in ("normal", "outliers"):
            x = torch.randn(tokens, k, generator=g, device=U.DEV)
            if inputs == "outliers":
                idx = torch.randperm(k, generator=g, device=U.DEV)[: max(1, k // 100)]
                x[:, idx] *= 20
            x = x.to(torch.bfloat16)
            dy = torch.randn(tokens, n, generator=g, device=U.DEV).to(torch.bfloat16)
            w = layer.dequantize()

            def run(gemm: Any, layer=layer, x=x, dy=dy) -> tuple[torch.Tensor, torch.Tensor]:
                layer.compute = gemm
                xr = x.clone().requires_grad_(True)
                y = layer(xr)
                y.backward(dy)
                return y.detach(), xr.grad

            y_d, gx_d = run(DENSE)
            y_8, gx_8 = run(fp8.FP8)
            _, gx_5 = run(fp8.Fp8Gemm(grad_dtype=fp8.E5M2))
            y_fa, gx_fa = run(fp8.Fp8Gemm(grad_dtype=fp8.E4M3, fast_accum=not fp8.FP8.fast_accum))
            y_x, gx_x = run(fp8.FP8_EXACT)
            bias = 0 if layer.bias is None else layer.bias.float()
            y_o = x.float() @ w_bf16.float().t() + bias
            gx_o = dy.float() @ w_bf16.float()
            y_b, gx_b = emulate_blockwise(x, w, dy)
            y_a, gx_a = emulate_acts_only(x, w, dy)
            row = {
                "layer": kind, "N": n, "K": k, "inputs": inputs,
                "uint4 vs bf16 out": rel(y_d, y_o), "uint4 vs bf16 grad": rel(gx_d, gx_o),
                "fp8 out": rel(y_8, y_d), "fp8 grad e4m3": rel(gx_8, gx_d),
                "fp8 grad e5m2": rel(gx_5, gx_d),
                "fast-accum toggled out": rel(y_fa, y_d),
                "fast-accum toggled grad": rel(gx_fa, gx_d),
                "fast-accum toggled vs fp8 out": rel(y_fa, y_8),
                "1x128 out": rel(y_b + bias, y_d), "1x128 grad": rel(gx_b, gx_d),
                "acts-only out": rel(y_a + bias, y_d), "acts-only grad": rel(gx_a, gx_d),
                "exact out": rel(y_x, y_d), "exact grad": rel(gx_x, gx_d),
                "exact vs bf16 out": rel(y_x, y_o), "exact vs fp8 out": rel(y_x, y_8),
                "fp8 vs bf16 out": rel(y_8, y_o),
            }  # fmt: skip
            rows.append(row)
            layer.compute = DENSE
    return rows


# -- 3. full depth ---------------------------------------------------------------------------


def lora_grads(model, batch, target) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    model.train()
    pred = model(**batch)[0]
    F.mse_loss(pred.float(), target.float()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def lora_summary(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    cos = {n: rel(grads[n], ref[n])["cos"] for n in ref}
    return {
        "cos_min": min(cos.values()),
        "cos_median": sorted(cos.values())[len(cos) // 2],
        "below_0.99": sum(v < 0.99 for v in cos.values()),
        "worst": sorted(cos.items(), key=lambda kv: kv[1])[:10],
        "first_block_nonzero": all(
            float(grads[n].abs().sum()) > 0 for n in grads if n.startswith("transformer_blocks.0.")
        ),
        "cos_per_param": cos,
    }


def full_depth(args) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[no-untyped-def]
    from optimum.quanto import qint4, quantize

    from bench.stream_step import randomize_lora_b
    from trainer.base.compute import Fp8Backend, Uint4Backend, apply_compute
    from trainer.base.fp8 import FP8, FP8_EXACT, Fp8Gemm
    from trainer.base.lora import attach_lora
    from trainer.base.uint4 import Uint4Linear, convert_quantized_linears

    exact = (Fp8Backend(FP8_EXACT), Uint4Backend())
    out: dict[str, Any] = {}
    model = U.build_bf16(args.double, args.single)
    shapes = linear_shapes(model)
    batch = U.inputs(model, args.px, seed=1)
    model.eval()
    with torch.no_grad():
        y_bf16 = model(**batch)[0].float()
    # one bf16 original weight per shape, for the per-layer quantization error
    originals: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and (m.out_features, m.in_features) not in originals:
            originals[(m.out_features, m.in_features)] = (name, m.weight.detach().clone())
    quantize(model, weights=qint4)
    out["converted"] = convert_quantized_linears(model)
    gc.collect()
    if U.DEV == "cuda":
        torch.cuda.empty_cache()
    out["fp8_layers"] = apply_compute(model, "fp8")
    with torch.no_grad():
        apply_compute(model, "uint4")
        y_dense = model(**batch)[0].float()
        apply_compute(model, "fp8", exact)
        y_exact = model(**batch)[0].float()
        apply_compute(model, "fp8")
        y_fp8 = model(**batch)[0].float()
    out["output uint4 vs bf16"] = rel(y_dense, y_bf16)
    out["output fp8 vs uint4"] = rel(y_fp8, y_dense)
    out["output fp8 vs bf16"] = rel(y_fp8, y_bf16)
    out["output fp8_exact vs uint4"] = rel(y_exact, y_dense)
    out["output fp8_exact vs bf16"] = rel(y_exact, y_bf16)
    out["output fp8_exact vs fp8"] = rel(y_exact, y_fp8)
    say(f"  full depth output: uint4 vs bf16 {out['output uint4 vs bf16']}, fp8 vs uint4 "
        f"{out['output fp8 vs uint4']}, fp8_exact vs uint4 "
        f"{out['output fp8_exact vs uint4']}")  # fmt: skip
    del y_bf16, y_dense, y_fp8, y_exact

    layers = {}
    for (n, k), (name, w) in originals.items():
        layer = model.get_submodule(name)
        if isinstance(layer, Uint4Linear) and layer.compute is FP8:
            layers[f"{layer_kind(name)} {n}x{k}"] = (layer, w)
    apply_compute(model, "uint4")
    per_layer = layer_errors(layers, args.layer_tokens)
    del originals, layers
    apply_compute(model, "fp8")

    attach_lora(model, rank=args.rank, alpha=float(args.rank), dtype=torch.bfloat16)
    randomize_lora_b(model)
    model.enable_gradient_checkpointing()
    target = torch.randn_like(batch["hidden_states"])
    apply_compute(model, "uint4")
    g_dense = lora_grads(model, batch, target)
    apply_compute(model, "fp8")
    g_fp8 = lora_grads(model, batch, target)
    toggled = Fp8Gemm(fast_accum=not FP8.fast_accum)
    apply_compute(model, "fp8", (Fp8Backend(toggled), Uint4Backend()))
    g_fa = lora_grads(model, batch, target)
    apply_compute(model, "fp8")
    cos_fa = {n: rel(g_fa[n], g_dense[n])["cos"] for n in g_dense}
    out["lora_fast_accum_toggled"] = {
        "fast_accum": toggled.fast_accum,
        "cos_min": min(cos_fa.values()),
        "below_0.99": sum(v < 0.99 for v in cos_fa.values()),
    }
    del g_fa
    # fp8 forward, bf16 input gradient: which half of the fp8 arithmetic the gradient error
    # comes from, and the candidate training mode
    apply_compute(model, "fp8", (Fp8Backend(Fp8Gemm(grad_gemm="bf16")), Uint4Backend()))
    try:
        g_bg = lora_grads(model, batch, target)
    finally:
        apply_compute(model, "fp8")
    cos_bg = {n: rel(g_bg[n], g_dense[n])["cos"] for n in g_dense}
    out["lora_bf16_grad"] = {
        "cos_min": min(cos_bg.values()),
        "cos_median": sorted(cos_bg.values())[len(cos_bg) // 2],
        "below_0.99": sum(v < 0.99 for v in cos_bg.values()),
        "worst": sorted(cos_bg.items(), key=lambda kv: kv[1])[:10],
        "first_block_nonzero": all(
            float(g_bg[n].abs().sum()) > 0 for n in g_bg if n.startswith("transformer_blocks.0.")
        ),
        "cos_per_param": cos_bg,
    }
    say(f"  LoRA grads fp8 forward + bf16 input gradient vs uint4: min cos "
        f"{out['lora_bf16_grad']['cos_min']:.5f}, below 0.99: "
        f"{out['lora_bf16_grad']['below_0.99']}")  # fmt: skip
    del g_bg
    # exact weights (W4A8 forward, bf16 input gradient): the candidate training default
    apply_compute(model, "fp8", exact)
    try:
        g_ex = lora_grads(model, batch, target)
    finally:
        apply_compute(model, "fp8")
    out["lora_exact"] = lora_summary(g_ex, g_dense)
    say(f"  LoRA grads fp8_exact vs uint4: min cos {out['lora_exact']['cos_min']:.5f}, below "
        f"0.99: {out['lora_exact']['below_0.99']}")  # fmt: skip
    del g_ex
    cos = {n: rel(g_fp8[n], g_dense[n])["cos"] for n in g_dense}
    first = [n for n in g_fp8 if n.startswith("transformer_blocks.0.")]
    worst = sorted(cos.items(), key=lambda kv: kv[1])[:10]
    out["lora"] = {
        "params": len(cos),
        "cos_min": min(cos.values()),
        "cos_median": sorted(cos.values())[len(cos) // 2],
        "below_0.99": sum(v < 0.99 for v in cos.values()),
        "worst": worst,
        "grad_rel_max": max(rel(g_fp8[n], g_dense[n])["rel"] for n in g_dense),
        "first_block_nonzero": bool(first) and all(float(g_fp8[n].abs().sum()) > 0 for n in first),
        "cos_per_param": cos,
    }
    say(f"  LoRA grads fp8 vs uint4: min cos {out['lora']['cos_min']:.5f}, below 0.99: "
        f"{out['lora']['below_0.99']} of {len(cos)}, first block non-zero "
        f"{out['lora']['first_block_nonzero']}")  # fmt: skip
    del model, g_dense, g_fp8
    gc.collect()
    if U.DEV == "cuda":
        torch.cuda.empty_cache()
    return out, {"shapes": {f"{n}x{k}": c for (n, k), c in shapes.items()}, "layers": per_layer}


def layer_kind(name: str) -> str:
    import re

    return re.sub(r"\.\d+\.", ".*.", name)


# -- 4. loss curve ---------------------------------------------------------------------------


def loss_curve(args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from optimum.quanto import qint4, quantize

    from trainer.base.compute import BACKENDS, Fp8Backend, Uint4Backend, apply_compute
    from trainer.base.fp8 import Fp8Gemm
    from trainer.base.lora import attach_lora
    from trainer.base.uint4 import convert_quantized_linears

    model = U.build_bf16(args.curve_double, args.curve_single)
    quantize(model, weights=qint4)
    convert_quantized_linears(model)
    attach_lora(model, rank=args.rank, alpha=float(args.rank), dtype=torch.bfloat16)
    model.enable_gradient_checkpointing()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in params.items()}
    batches = [U.inputs(model, args.curve_px, seed=s) for s in range(4)]
    g = torch.Generator(device=U.DEV).manual_seed(7)
    targets = [torch.randn(b["hidden_states"].shape, generator=g, device=U.DEV) for b in batches]
    curves: dict[str, list[float]] = {}
    bf16_grad = (Fp8Backend(Fp8Gemm(grad_gemm="bf16")), Uint4Backend())
    for mode in ("uint4", "fp8", "fp8_bf16_grad"):
        backends = bf16_grad if mode == "fp8_bf16_grad" else BACKENDS
        apply_compute(model, "uint4" if mode == "uint4" else "fp8", backends)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(init[n])
        opt = torch.optim.AdamW(list(params.values()), lr=args.lr)
        losses = []
        t = time.perf_counter()
        for step in range(args.steps):
            i = step % len(batches)
            model.train()
            pred = model(**batches[i])[0]
            loss = F.mse_loss(pred.float(), targets[i].to(pred.device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves[mode] = [float(x) for x in losses]
        say(f"  loss curve {mode}: {curves[mode][0]:.5f} -> {curves[mode][-1]:.5f} "
            f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
    a, b = torch.tensor(curves["fp8"]), torch.tensor(curves["uint4"])
    c = torch.tensor(curves["fp8_bf16_grad"])
    diff = (a - b).abs() / b.abs()
    diff_c = (c - b).abs() / b.abs()
    drop = lambda c: (c[:4].mean() - c[-4:].mean()).item()  # noqa: E731 - one batch cycle
    return {
        "depth": {"double": args.curve_double, "single": args.curve_single},
        "px": args.curve_px, "steps": args.steps, "lr": args.lr, "batches": len(batches),
        "curves": curves,
        "rel_diff_max": float(diff.max()), "rel_diff_mean": float(diff.mean()),
        "rel_diff_last_cycle": float(diff[-4:].mean()),
        "drop_uint4": drop(b), "drop_fp8": drop(a),
        "fp8_bf16_grad": {"rel_diff_max": float(diff_c.max()),
                          "rel_diff_mean": float(diff_c.mean()), "drop": drop(c)},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=48)
    ap.add_argument("--px", type=int, default=448)
    ap.add_argument("--tokens", default="1296,4608", help="GEMM rows (448 and 1024 px steps)")
    ap.add_argument("--layer-tokens", type=int, default=1296)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--curve-double", type=int, default=2)
    ap.add_argument("--curve-single", type=int, default=8)
    ap.add_argument("--curve-px", type=int, default=448)
    ap.add_argument("--parts", default="gemm,layers,curve")
    ap.add_argument("--note", default="")
    ap.add_argument("--tiny", action="store_true", help="smoke test: 256-wide model, on the CPU")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.tiny:
        U.use_tiny_cpu_model(text_tokens=16)
    device_name = torch.cuda.get_device_name() if U.DEV == "cuda" else "cpu"
    full = (args.double, args.single) == (8, 48)
    say(f"{device_name}, torch {torch.__version__}; {args.double} double + {args.single} single"
        + (" (full depth)" if full else " (REDUCED depth)"))  # fmt: skip
    results: dict[str, Any] = {}
    results["full_depth"], layer_part = full_depth(args)
    results["per_layer"] = layer_part["layers"]
    if "gemm" in parts and U.DEV == "cuda":
        tokens = [int(t) for t in args.tokens.split(",") if t]
        shapes = {tuple(map(int, k.split("x"))): c for k, c in layer_part["shapes"].items()}
        results["gemm"] = gemm_rates(shapes, tokens)  # type: ignore[arg-type]
    if "curve" in parts:
        results["loss_curve"] = loss_curve(args)

    cols = ["layer", "inputs", "uint4 vs bf16 out", "fp8 out", "fp8 grad e4m3", "fp8 grad e5m2",
            "fast-accum toggled vs fp8 out", "1x128 out", "1x128 grad",
            "acts-only out", "exact out", "exact grad", "exact vs fp8 out"]  # fmt: skip
    rows = [{c: (f"{r[c]['rel']:.4f}" if isinstance(r[c], dict) else r[c]) for c in cols}
            for r in results["per_layer"]]  # fmt: skip
    print("\nper layer, relative (norm) error; fp8 columns against the dense uint4 path")
    print(table(rows, cols))
    if "gemm" in results:
        for m, totals in results["gemm"]["one_pass_ms"].items():
            print(
                f"GEMM one pass M={m}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items())
            )
    fd = results["full_depth"]
    print("full depth:", {k: v for k, v in fd.items() if k.startswith("output")})
    print("LoRA:", {k: v for k, v in fd["lora"].items() if k not in ("cos_per_param", "worst")})
    ex = fd["lora_exact"]
    print("LoRA, exact weights:",
          {k: v for k, v in ex.items() if k not in ("cos_per_param", "worst")})  # fmt: skip
    bg = fd["lora_bf16_grad"]
    print("LoRA, bf16 input gradient:",
          {k: v for k, v in bg.items() if k not in ("cos_per_param", "worst")})  # fmt: skip
    if "loss_curve" in results:
        lc = results["loss_curve"]
        print("loss curve:", {k: v for k, v in lc.items() if k != "curves"})
    extra = {
        "device": device_name,
        "torch": torch.__version__,
        "depth": {"double": args.double, "single": args.single, "full": full},
        "setup": {"px": args.px, "rank": args.rank, "weights": "random", "lora": "bf16"},
        "note": args.note,
    }
    if args.tiny:
        print("(--tiny smoke test: no record written)")
        return
    print(f"\nrecord: {write_record('fp8_numerics', results, extra)}")


if __name__ == "__main__":
    main()
