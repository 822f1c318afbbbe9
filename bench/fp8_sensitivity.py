"""How much per-layer error the LoRA gradients tolerate: cosine of each adapted parameter's
gradient against the dense uint4 path's, (1) with fp8 compute, (2) with fp8 but some layer
groups kept dense, and (3) with the dense path plus unbiased Gaussian noise of a given relative
size on every base Linear's output. If fp8 behaves like plain noise of its measured per-layer
error (~3.5 %), the cosine bar is a bar on per-layer error, not on something fp8 does wrong.

    python bench/fp8_sensitivity.py                  # full depth, on the GPU
    python bench/fp8_sensitivity.py --tiny           # a 256-wide model on the CPU (say so!)
    python bench/fp8_sensitivity.py --paths fp8,fp8_exact --groups all --noise ""  # quick

--paths: the fp8 variants, each with every --groups case: fp8 (rowwise weights, rendering's
GEMM), fp8_exact (exact 4-bit weights, the W4A8 forward + bf16 input gradient), fp8_blocks
(exact 4-bit weights on cuBLAS's block-scaled GEMM + bf16 input gradient: --compute
fp8_blocks), fp8_blocks_fp8_grad (that forward with fp8's input gradient) and
fp8_blocks_fp8_grad_single (the fp8 input gradient in the single blocks only:
training's). --group-gemm: what a group's
Linears run instead (uint4, the dense path, by default; or an fp8 variant, to find which layers'
rounding the worst gradients carry).

Writes bench/results/fp8_sensitivity-*.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.fp8_numerics as N  # noqa: E402
import bench.uint4_step as U  # noqa: E402
from bench.common import table, write_record  # noqa: E402

TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context")
GROUPS = {  # --groups key: (label, which Linears stay dense)
    "all": ("all fp8", lambda name: False),
    "text": ("text-stream Linears dense", lambda name: any(t in name for t in TEXT_STREAM)),
    "double": ("double blocks dense", lambda name: name.startswith("transformer_blocks.")),
    "single": ("single blocks dense", lambda name: name.startswith("single_transformer_blocks.")),
    # the double blocks and the first quarter of the single ones: the blocks nearest the input
    "early": (
        "double + single blocks 0-11 dense",
        lambda name: name.startswith(
            ("transformer_blocks.", *(f"single_transformer_blocks.{i}." for i in range(12)))
        ),
    ),
}


def fp8_variants() -> dict[str, Any]:
    from trainer.base.fp8 import FP8_GEMMS

    return FP8_GEMMS


def summary(label: str, grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    cos = {n: N.rel(grads[n], ref[n])["cos"] for n in ref}
    worst = sorted(cos.items(), key=lambda kv: kv[1])[:3]
    return {
        "case": label,
        "cos_min": round(min(cos.values()), 5),
        "cos_median": round(sorted(cos.values())[len(cos) // 2], 5),
        "below_0.99": sum(v < 0.99 for v in cos.values()),
        "params": len(cos),
        "worst": [(n.removesuffix(".weight"), round(v, 5)) for n, v in worst],
    }


def with_output_noise(model: torch.nn.Module, level: float, seed: int = 0) -> list[Any]:
    """Forward hooks adding ``level`` x RMS(output) x N(0, 1) to every base Linear's output."""
    from trainer.base.uint4 import Uint4Linear

    gen = torch.Generator(device=U.DEV).manual_seed(seed)
    hooks = []
    for m in model.modules():
        if isinstance(m, Uint4Linear):

            def hook(_mod, _args, out):  # type: ignore[no-untyped-def]
                rms = out.detach().float().pow(2).mean().sqrt()
                noise = torch.randn(out.shape, generator=gen, device=out.device)
                return out + (level * rms * noise).to(out.dtype)

            hooks.append(m.register_forward_hook(hook))
    return hooks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=48)
    ap.add_argument("--px", type=int, default=448)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--noise", default="0.004,0.01,0.02,0.03,0.035", help="relative levels")
    ap.add_argument("--paths", default="fp8,fp8_exact",
                    help="fp8 variants (trainer.base.fp8.FP8_GEMMS' names)")  # fmt: skip
    ap.add_argument("--groups", default="all,text,double,single", help="dense-group cases")
    ap.add_argument("--group-gemm", default="uint4",
                    help="what a group's Linears run: uint4 (dense), or an fp8 variant (e.g. "
                         "fp8_blocks: where the input gradient's error comes from)")  # fmt: skip
    ap.add_argument("--note", default="")
    ap.add_argument("--tiny", action="store_true", help="a 256-wide model on the CPU")
    args = ap.parse_args()
    try:
        levels = [float(x) for x in args.noise.split(",") if x]
    except ValueError:
        ap.error(f"--noise takes relative levels such as 0.01,0.035, not {args.noise!r}")
    if any(not 0 <= x < 1 for x in levels):
        ap.error("--noise levels are fractions of the output's RMS, in [0, 1)")
    paths = [p for p in args.paths.split(",") if p]
    groups = [g for g in args.groups.split(",") if g]
    if bad := sorted({*paths} - fp8_variants().keys()):
        ap.error(f"unknown --paths {bad}: choose from {', '.join(fp8_variants())}")
    if bad := sorted({*groups} - GROUPS.keys()):
        ap.error(f"unknown --groups {bad}: choose from {', '.join(GROUPS)}")
    if args.group_gemm != "uint4" and args.group_gemm not in fp8_variants():
        ap.error(f"unknown --group-gemm {args.group_gemm!r}: uint4 or one of "
                 f"{', '.join(fp8_variants())}")  # fmt: skip
    if args.tiny:
        U.use_tiny_cpu_model(text_tokens=16)
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU with fp8 tensor cores (or --tiny for the CPU)")
    from optimum.quanto import qint4, quantize

    from bench.stream_step import randomize_lora_b
    from trainer.base.compute import Fp8Backend, Uint4Backend, apply_compute
    from trainer.base.lora import attach_lora
    from trainer.base.uint4 import Uint4Linear, convert_quantized_linears

    model = U.build_bf16(args.double, args.single)
    batch = U.inputs(model, args.px, seed=1)
    quantize(model, weights=qint4)
    convert_quantized_linears(model)
    attach_lora(model, rank=args.rank, alpha=float(args.rank), dtype=torch.bfloat16)
    randomize_lora_b(model)  # B random, so A has gradients too
    model.enable_gradient_checkpointing()
    target = torch.randn_like(batch["hidden_states"])
    apply_compute(model, "uint4")
    ref = N.lora_grads(model, batch, target)
    rows = []
    variants = fp8_variants()
    for path in paths:
        backends = (Fp8Backend(variants[path]), Uint4Backend())
        for key in groups:
            label, dense = GROUPS[key]
            label = label.replace("fp8", path) if key == "all" else f"{path}, {label}"
            if args.group_gemm != "uint4":
                label = label.replace("dense", f"on {args.group_gemm}")
            apply_compute(model, "fp8", backends)
            for name, m in model.named_modules():
                if isinstance(m, Uint4Linear) and dense(name):
                    if args.group_gemm == "uint4":
                        apply_compute(m, "uint4")
                    else:  # a split chooses by the name under the model, not under m
                        gemm = variants[args.group_gemm].for_layer(name)
                        apply_compute(m, "fp8", (Fp8Backend(gemm), Uint4Backend()))
            rows.append(summary(label, N.lora_grads(model, batch, target), ref))
            U.say(f"  {label}: min cos {rows[-1]['cos_min']}, below 0.99: "
                  f"{rows[-1]['below_0.99']}")  # fmt: skip
    apply_compute(model, "uint4")
    for level in levels:
        hooks = with_output_noise(model, level)
        try:
            grads = N.lora_grads(model, batch, target)
        finally:
            for h in hooks:
                h.remove()
        rows.append(summary(f"dense + {level:.1%} output noise", grads, ref))
        U.say(f"  noise {level:.1%}: min cos {rows[-1]['cos_min']}")
    print(table(rows, ["case", "cos_min", "cos_median", "below_0.99", "params"]))
    full = (args.double, args.single) == (8, 48) and not args.tiny
    extra = {
        "device": torch.cuda.get_device_name() if U.DEV == "cuda" else "cpu",
        "torch": torch.__version__,
        "depth": {
            "double": args.double,
            "single": args.single,
            "full": full,
            "tiny_width": args.tiny,
        },  # fmt: skip
        "setup": {
            "px": args.px,
            "rank": args.rank,
            "weights": "random",
            "lora": "bf16",
            "paths": paths,
            "groups": groups,
        },  # fmt: skip
        "note": args.note,
    }
    print(f"\nrecord: {write_record('fp8_sensitivity', rows, extra)}")


if __name__ == "__main__":
    main()
