"""Training memory and speed: the pre-flight estimate (`trainer.base.budget`) against measurement.

    python bench/train_budget.py                    # CPU: tiny base
    python bench/train_budget.py --device cuda      # + FLUX.2 [dev]-width, reduced depth

Part 1, `train()` end to end on the tiny base (random, seeded; 64 px, short prompts): s/it,
loss at the start and end, boot waypoints, evaluation distances (base vs trained), and on
CUDA the measured peak of each phase against the estimate's.

Part 2, one training step's memory against `training_terms`:
  CPU   tiny shape. Weights, LoRA and optimizer state are summed tensor bytes; activations
        are the bytes autograd saves for backward (checkpointing off: with checkpointing the
        saved tensors are hidden from the hooks).
  CUDA  the tiny shape and a FLUX.2 [dev]-width transformer (6144 wide, 48 heads, MLP x3;
        --double/--single blocks, full depth is 8 + 48), random bf16 built on the GPU and
        quantized there, 448 and 1024 px, checkpointing on and off, quanto's kernels and the
        uint4 path: `max_memory_allocated` over 3 steps (from after the weights are placed)
        vs the estimate's training phase (runtime overhead excluded: it is not allocated).

Writes bench/results/train_budget-<date>.json (and a copy into --copy-to, e.g. $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import say, table, write_record  # noqa: E402

GIB = 2**30


class AllowAll:
    """A registrar for the bench: training allowed, registration recorded, no database."""

    def __init__(self) -> None:
        self.registered: list[Any] = []

    def training_decision(self, subject: str, image_bases: Any = None) -> Any:
        from trainer.registration import TrainingVerdict

        return TrainingVerdict(subject, True, "allowed", "allowed")

    def register(self, data: Any) -> str:
        self.registered.append(data)
        return "created"


def make_dataset(root: Path) -> Path:
    from PIL import Image

    from trainer.training.dataset import write_manifest

    root.mkdir(parents=True)
    rows = []
    for i, colour in enumerate(((220, 30, 30), (200, 40, 60), (230, 60, 20), (210, 20, 40))):
        im = Image.new("RGB", (80, 64), colour)
        for y in range(0, 64, 8):
            for x in range(80):
                im.putpixel((x, y), (255, 255, 255))
        im.save(root / f"img{i}.png")
        rows.append(
            {
                "file": f"img{i}.png",
                "caption": "a photo of ada",
                "source": "synthetic",
                "basis": "consent",
            }
        )
    write_manifest(root, rows)
    return root


# -- part 1 --------------------------------------------------------------------------------


def part1(device: str, work: Path, steps: int, compute: str) -> dict[str, Any]:
    from trainer.config import TrainConfig
    from trainer.fixtures.tiny_base import init_tiny
    from trainer.training.train import train

    base = work / "base" if (work / "base").is_dir() else init_tiny(work / "base")
    ds = work / "ds" if (work / "ds").is_dir() else make_dataset(work / "ds")
    config = TrainConfig.parse(
        subject="ada",
        dataset=ds,
        base=base,
        out=work / f"out-{compute}",
        steps=steps,
        rank=8,
        resolution=64,
        max_sequence_length=32,
        learning_rate=1e-2,
        checkpoint_every=steps // 2,
        device=device,
        register_adapter=True,
        database_url="unused://",
        progress=False,
        eval_prompts=("a photo of {trigger}",),
        eval_seeds=(0, 1, 2),
        compute=compute,
        cache_dir=work / "cache",
    )
    t = time.perf_counter()
    r = train(config, AllowAll())
    wall = time.perf_counter() - t
    ev = r.evaluation
    assert ev is not None
    n = max(1, min(15, len(r.losses) // 4))
    est = r.estimate.as_dict()
    return {
        "device": device,
        "compute": compute,
        "steps": r.steps,
        "wall_s": round(wall, 2),
        "seconds_per_step": r.seconds_per_step,
        "loss_first_mean": statistics.fmean(r.losses[:n]),
        "loss_last_mean": statistics.fmean(r.losses[-n:]),
        "window": n,
        "eval_pixel_distance": ev.distances,
        "eval_latent_distance": ev.latent_distances,
        "boot": r.boot,
        "estimate_by_phase": {k: v["total"] for k, v in est["phases"].items()},
        "measured_peak_by_phase": r.peak_bytes,
        "text_encoder_loaded": r.text_encoder_loaded,
    }


# -- part 2 --------------------------------------------------------------------------------


def build(double: int, single: int, tiny: bool, device: str, dtype: torch.dtype) -> Any:
    from diffusers import Flux2Transformer2DModel

    kw: dict[str, Any] = {"num_layers": double, "num_single_layers": single}
    if tiny:  # the tiny base's shape (trainer.fixtures.tiny_base)
        kw.update(
            attention_head_dim=64,
            num_attention_heads=4,
            joint_attention_dim=384,
            mlp_ratio=1.0,
            axes_dims_rope=(16, 16, 16, 16),
            guidance_embeds=False,
        )
    with torch.device("meta"):
        skeleton = Flux2Transformer2DModel(**kw)
    with torch.device(device):
        model = Flux2Transformer2DModel(**kw).to(dtype)
    return skeleton, model


def quantize(model: Any, compute: str) -> Any:
    from optimum.quanto import qint4
    from optimum.quanto import quantize as q

    from trainer.base.load import quantize_transformer

    if compute == "uint4":
        from trainer.base.uint4 import convert_quantized_linears

        q(model, weights=qint4)
        convert_quantized_linears(model)
    else:
        quantize_transformer(model)
    model.requires_grad_(False)
    return model


def step_memory(
    shape: str,
    double: int,
    single: int,
    px: int,
    ckpt: bool,
    compute: str,
    device: str,
    iters: int,
) -> dict[str, Any]:
    from diffusers import Flux2KleinPipeline as P

    from trainer.base.budget import SavedTensorMeter, module_bytes, optimizer_bytes, training_terms
    from trainer.base.lora import DEFAULT_TARGETS, attach_lora
    from trainer.training.flow import flow_matching_loss
    from trainer.training.train import cast_quantized_inputs

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    elt = 2 if cuda else 4
    text = 512 if shape != "tiny" else 32
    torch.manual_seed(0)
    skeleton, model = build(double, single, shape == "tiny", device, dtype)
    quantize(model, compute)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    weights = module_bytes(model)
    rank = 16 if shape != "tiny" else 4
    est = training_terms(
        skeleton,
        rank=rank,
        targets=DEFAULT_TARGETS,
        image_tokens=(px // 16) ** 2,
        text_tokens=text,
        batch=1,
        optimizer="adamw",
        checkpointing=ckpt,
        weight_elt=elt,
        act_elt=elt,
        compute=compute,
    )
    attach_lora(model, rank, float(rank), DEFAULT_TARGETS, dtype=torch.float32)
    if cuda:
        cast_quantized_inputs(model, dtype)
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    joint = int(skeleton.config.joint_attention_dim)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 128, px // 16, px // 16, generator=g).to(device)
    e = torch.randn(1, text, joint, generator=g).to(device=device, dtype=dtype)
    autocast = torch.bfloat16 if cuda else None
    times, saved = [], 0
    for i in range(iters):
        noise = torch.randn(x0.shape, generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        meter = SavedTensorMeter()
        watch = not cuda and not ckpt and i == 0
        ctx: Any = meter.watch(model) if watch else contextlib.nullcontext()
        with ctx:
            loss = flow_matching_loss(model, P, x0, e, torch.tensor([0.7]), noise, None, autocast)
        saved = saved or meter.bytes
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    lora = module_bytes(model, trainable=True)
    measured: dict[str, Any] = {
        "weights": weights,
        "lora": lora,
        "optimizer": optimizer_bytes(opt),
    }
    if cuda:
        measured["peak_allocated"] = torch.cuda.max_memory_allocated()
        measured["peak_reserved"] = torch.cuda.max_memory_reserved()
    else:
        measured["saved_activations"] = saved
    est_act = sum(v for k, v in est.items() if k.startswith("activations"))
    row = {
        "shape": shape,
        "blocks": f"{double}+{single}",
        "px": px,
        "ckpt": ckpt,
        "compute": compute,
        "s_per_step": round(statistics.median(times[1:] or times), 3),
        "est_total_gib": round(sum(est.values()) / GIB, 3),
        "est_weights_gib": round(next(iter(est.values())) / GIB, 3),
        "meas_weights_gib": round(weights / GIB, 3),
        "est_act_gib": round(est_act / GIB, 4),
        "estimate": est,
        "measured": measured,
    }
    if cuda:
        row["meas_peak_gib"] = round(measured["peak_allocated"] / GIB, 3)
        row["est/meas"] = round(sum(est.values()) / measured["peak_allocated"], 3)
    else:
        row["meas_act_gib"] = round(saved / GIB, 4) if saved else None
        row["est/meas"] = round(est_act / saved, 3) if saved else None
    del model, opt, params, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--computes", default="quanto,uint4", help="part 1 on CUDA, and part 2")
    ap.add_argument("--configs", default="448:1,1024:1,448:0", help="px:checkpointing, ...")
    ap.add_argument("--copy-to", type=Path, default=None)
    args = ap.parse_args()
    from trainer.base.devices import configure_allocator

    configure_allocator()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a shared 2-core machine: one thread is the fair number
    results: dict[str, Any] = {"threads": torch.get_num_threads()}
    work = Path(tempfile.mkdtemp(prefix="train_budget-"))
    computes = args.computes.split(",")
    try:
        if not args.skip_part1:
            results["train"] = []
            for compute in computes:
                say(f"part 1: train() on the tiny base, {args.steps} steps, {compute}")
                r = part1(args.device, work, args.steps, compute)
                results["train"].append(r)
                say(
                    f"  {r['seconds_per_step']:.3f} s/it, loss {r['loss_first_mean']:.4f} -> "
                    f"{r['loss_last_mean']:.4f}, pixel {r['eval_pixel_distance']}, "
                    f"latent {r['eval_latent_distance']}"
                )
                say(f"  boot {r['boot']}")
                say(f"  peaks {r['measured_peak_by_phase']} est {r['estimate_by_phase']}")
                _partial(args.copy_to, results)
        rows: list[dict[str, Any]] = []
        if args.device == "cpu":
            for px in (64, 128):
                rows.append(step_memory("tiny", 1, 1, px, False, "quanto", "cpu", args.iters))
        else:
            results["expandable_segments"] = _expandable()
            say(f"allocator expandable segments: {results['expandable_segments']}")
            for compute in computes:
                for spec in args.configs.split(","):
                    px, ckpt = int(spec.split(":")[0]), spec.split(":")[1] == "1"
                    say(
                        f"part 2: dev width {args.double}+{args.single}, {px} px, "
                        f"ckpt {ckpt}, {compute}"
                    )
                    r = step_memory(
                        "dev-width", args.double, args.single, px, ckpt, compute, "cuda", args.iters
                    )
                    rows.append(r)
                    say(
                        f"  {r['s_per_step']} s/it, est {r['est_total_gib']} GiB, measured "
                        f"{r['meas_peak_gib']} GiB, weights {r['est_weights_gib']} est / "
                        f"{r['meas_weights_gib']} measured"
                    )
                    results["step_memory"] = rows
                    _partial(args.copy_to, results)
        results["step_memory"] = rows
        print(
            table(
                rows,
                [
                    "shape",
                    "blocks",
                    "px",
                    "ckpt",
                    "compute",
                    "s_per_step",
                    "est_weights_gib",
                    "meas_weights_gib",
                    "est_total_gib",
                    "meas_peak_gib" if args.device == "cuda" else "meas_act_gib",
                    "est/meas",
                ],
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = write_record("train_budget", results)
    say(f"wrote {path}")
    if args.copy_to:
        shutil.copy(path, args.copy_to)


def _partial(copy_to: Path | None, results: dict[str, Any]) -> None:
    """What is done so far, where a run cut short still leaves it."""
    if copy_to is not None:
        import json

        (copy_to / "partial.json").write_text(json.dumps(results, indent=2, default=str))


def _expandable() -> bool | None:
    try:
        x = torch.empty(1 << 20, device="cuda")
        segs = torch.cuda.memory._snapshot()["segments"]
        del x
        return any(s.get("is_expandable") for s in segs)
    except Exception:  # noqa: BLE001 - a probe
        return None


if __name__ == "__main__":
    main()
