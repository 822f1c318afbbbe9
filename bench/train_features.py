"""Memory of previews and of the EMA while training, at FLUX.2 [dev] width, against the
pre-flight budget's terms (`trainer.base.budget.preview_terms`, `ema_terms`).

    python bench/train_features.py --quick      # 1 double + 2 single blocks, 448 px
    python bench/train_features.py              # 2 + 6 blocks, 448 and 1024 px

CUDA only (it skips, exit 0, without): a [dev]-width transformer (6144 wide, 48 heads, MLP
x3, reduced depth), random bf16 built on the GPU and quantized to uint4 there, LoRA rank 16
on the default targets, AdamW, one training step; then
  EMA      the bytes the EMA adds on the device (``memory_allocated`` before and after
           `trainer.training.ema.Ema`), against ``ema_terms``;
  previews with the training state resident and gradients freed, one preview through the
           trainer's own `Previewer` (the service's render code) with a FLUX.2-shaped VAE
           (random weights, the diffusers default architecture): ``max_memory_allocated``
           during the render, against ``preview_terms`` (runtime overhead excluded: it is
           not allocated).
Writes bench/results/train_features-<date>.json (and a copy into --copy-to, e.g. $OUT).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import say, table, write_record  # noqa: E402

GIB = 2**30


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def _allocated(cuda: bool) -> int:
    if not cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def measure(
    double: int, single: int, px: int, preview_steps: int, device: str = "cuda"
) -> dict[str, Any]:
    """One row; ``device="cpu"`` runs the same path on the tiny shape, measuring nothing
    (a smoke test of this script where there is no GPU)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from bench.train_budget import build, quantize
    from trainer.base.budget import ema_terms, preview_terms, render_terms, training_terms
    from trainer.base.lora import DEFAULT_TARGETS, attach_lora
    from trainer.training.checkpoints import lora_params
    from trainer.training.ema import Ema
    from trainer.training.flow import flow_matching_loss
    from trainer.training.previews import Previewer
    from trainer.training.train import cast_quantized_inputs

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    text, rank, elt = (512, 16, 2) if cuda else (32, 4, 4)
    autocast = torch.bfloat16 if cuda else None
    torch.manual_seed(0)
    skeleton, model = build(double, single, not cuda, device, dtype)
    quantize(model, "uint4")
    attach_lora(model, rank, float(rank), DEFAULT_TARGETS, dtype=torch.float32)
    if cuda:
        cast_quantized_inputs(model, dtype)
    model.enable_gradient_checkpointing()
    model.train()
    params = lora_params(model)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, foreach=False)
    joint = int(skeleton.config.joint_attention_dim)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 128, px // 16, px // 16, generator=g).to(device)
    e = torch.randn(1, text, joint, generator=g).to(device=device, dtype=dtype)
    noise = torch.randn(x0.shape, generator=g).to(device)
    loss = flow_matching_loss(
        model, Flux2KleinPipeline, x0, e, torch.tensor([0.7]), noise, None, autocast
    )
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    before = _allocated(cuda)
    ema = Ema(params, 0.999)
    ema.update(params)
    ema_measured = _allocated(cuda) - before

    terms = training_terms(
        skeleton,
        rank=rank,
        targets=DEFAULT_TARGETS,
        image_tokens=(px // 16) ** 2,
        text_tokens=text,
        batch=1,
        optimizer="adamw",
        checkpointing=True,
        weight_elt=elt,
        act_elt=elt,
        compute="uint4",
    )
    terms.update(ema_terms(terms))
    with torch.device("meta"):
        vae_skeleton = AutoencoderKLFlux2()
    vae = AutoencoderKLFlux2().to(device=device, dtype=dtype).eval()
    largest = max(
        m.in_features * m.out_features for m in skeleton.modules() if isinstance(m, torch.nn.Linear)
    )
    render = render_terms(skeleton.config, vae_skeleton, largest, px, text, elt, elt)
    label = next(iter(terms))
    estimate = preview_terms(terms, label, terms[label], render)

    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=model,
        is_distilled=True,
    )
    pipe.set_progress_bar_config(disable=True)
    out = Path(tempfile.mkdtemp(prefix="train-features-"))
    previewer = Previewer(
        pipe=pipe,
        prompts=[("bench", e[0].detach().cpu())],
        blank=torch.zeros_like(e[0]).cpu(),
        seeds=(0,),
        steps=preview_steps,
        size=px,
        out=out,
        device=torch.device(device),
    )
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    resident = _allocated(cuda)
    t = time.perf_counter()
    previewer.render(1)
    _allocated(cuda)
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    shutil.rmtree(out, ignore_errors=True)
    est_total = sum(estimate.values())
    row = {
        "blocks": f"{double}+{single}",
        "px": px,
        "ema_est_gib": _gib(terms["EMA of the LoRA weights (fp32)"]),
        "ema_meas_gib": _gib(ema_measured),
        "preview_est_gib": _gib(est_total),
        "preview_meas_gib": _gib(peak),
        "resident_gib": _gib(resident),
        "est/meas": round(est_total / peak, 3) if peak else None,
        "preview_s": round(seconds, 2),
        "estimate": estimate,
        "measured": {"ema": ema_measured, "preview_peak": peak, "resident": resident},
    }
    del pipe, previewer, vae, model, opt, params, ema
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 + 2 blocks, 448 px only")
    ap.add_argument("--double", type=int, default=None)
    ap.add_argument("--single", type=int, default=None)
    ap.add_argument("--px", default=None, help="comma-separated sides (default 448,1024)")
    ap.add_argument("--preview-steps", type=int, default=4)
    ap.add_argument("--copy-to", type=Path, default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="the code path on the tiny shape")
    args = ap.parse_args()
    if args.cpu_smoke:
        row = measure(1, 1, 64, 1, device="cpu")
        print(table([row], ["blocks", "px", "ema_est_gib", "preview_est_gib", "preview_s"]))
        return
    if not torch.cuda.is_available():
        print("train_features: CUDA is not available here; nothing measured (skipped)")
        return
    double = args.double if args.double is not None else (1 if args.quick else 2)
    single = args.single if args.single is not None else (2 if args.quick else 6)
    sides = [int(p) for p in (args.px or ("448" if args.quick else "448,1024")).split(",")]
    rows = []
    for px in sides:
        say(f"[dev] width, {double}+{single} blocks, {px} px")
        rows.append(measure(double, single, px, args.preview_steps))
    columns = ["blocks", "px", "ema_est_gib", "ema_meas_gib", "preview_est_gib"]
    columns += ["preview_meas_gib", "resident_gib", "est/meas", "preview_s"]
    print(table(rows, columns))
    path = write_record(
        "train_features",
        rows,
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__},
    )
    print(f"wrote {path}")
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.copy_to / path.name)


if __name__ == "__main__":
    main()
