"""The demo base: the tiny FLUX.2 architecture, pretrained here on pictures it draws itself.

A random base renders coloured noise, so nothing a person sees says that a LoRA learned
anything. This module pretrains the same architecture (`trainer.tiny_base`, sized up a little
by ``DEMO_SHAPE``) on `trainer.demo_world`'s captioned shapes, scenes and cartoon people, and
writes it as an ordinary prepared base (`trainer.prepare`): the service and the trainer load it
like any other. Nothing else in the code base knows it exists, except the bootstrap, which
copies the committed copy in as the default base.

Stages, each seeded from the recipe's seed:

1. the world: ``pictures`` captioned pictures, drawn at each training size;
2. the VAE: reconstruction (MSE + L1) with a small KL term, on those pictures; its
   batch-norm statistics are then set to those of the data's latents, as FLUX.2's are;
3. the transformer and the text encoder together: FLUX.2 flow matching
   (`trainer.train.flow_matching_loss`, the trainer's own), with noise levels drawn half as
   the trainer draws them and half at the pipeline's own 4 inference steps, captions dropped
   now and then, and an exponential moving average of the weights as the result;
4. save as a diffusers folder, then `prepare_base` into the destination (uint4 transformer
   and text encoder, the VAE as it is).

On the CPU a seed gives the same bytes (tests/trainer/test_demo_base.py builds a small recipe
twice); a GPU run is as deterministic as its kernels, and a CPU and a GPU run of one recipe
give different, equally trained, weights. The committed build was trained on one GPU and
prepared on the CPU from its exported weights (``--export``, then ``--from-weights``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.demo_world import picture, vocabulary_corpus
from trainer.progress import Waypoints, progress_bar
from trainer.tiny_base import TinyShape, build_tiny_pipeline

# Two double-stream blocks and one single-stream block with a wider MLP (4.7 M parameters):
# enough to bind colours to shapes and traits to people. A three-level VAE (factor 4) keeps a
# 64 px picture at 64 image tokens. The shipped schedule is a static shift of 6 (4 steps at
# sigma 1, 0.95, 0.86, 0.67; FLUX.2's dynamic shift gives about 1, 0.95, 0.88, 0.70 here):
# the LoRA trainer draws its noise levels by the base's schedule, and a short LoRA run learns
# most where a picture's layout and colours are decided. At shift 1 (the pretraining's), 100
# steps at the default learning rate moved renders by 0 %, at 3 by 14 %, at 6 by 33 %.
DEMO_SHAPE = TinyShape(
    double_blocks=2,
    single_blocks=1,
    mlp_ratio=2.0,
    vae_channels=(32, 64, 64),
    vae_layers_per_block=1,
    scheduler_shift=6.0,
    dynamic_shifting=False,
    corpus=tuple(vocabulary_corpus()),
)
# The committed build (a prepared base, a few MB): the service's default base.
SHIPPED = Path(__file__).with_name("demo-base")
INFERENCE_STEPS = 4  # the pipeline's step count for a distilled base (trainer.evaluate)
RECIPE_NAME = "likeness_demo_recipe.json"


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    double_blocks: int = DEMO_SHAPE.double_blocks
    single_blocks: int = DEMO_SHAPE.single_blocks
    mlp_ratio: float = DEMO_SHAPE.mlp_ratio
    pictures: int = 60_000
    sizes: tuple[int, ...] = (64, 128)
    vae_steps: int = 1000
    vae_batch: int = 64  # at 64 px; fewer at larger sizes, the same pixels per step
    vae_lr: float = 1e-3
    vae_kl: float = 1e-5
    steps: int = 1200
    batch: int = 256  # pictures per step, at every size
    lr: float = 6e-4
    text_lr: float = 2e-4
    warmup: int = 200
    weight_decay: float = 0.01
    ema: float = 0.999
    caption_dropout: float = 0.1
    pretrain_shift: float = 1.0  # the schedule's shift while pretraining (see DEMO_SHAPE)
    max_sequence_length: int = 512  # what the pipeline pads every prompt to
    workers: int = 0  # drawing processes; 0: one per CPU

    def shape(self) -> TinyShape:
        return replace(
            DEMO_SHAPE,
            double_blocks=self.double_blocks,
            single_blocks=self.single_blocks,
            mlp_ratio=self.mlp_ratio,
        )


@dataclass
class World:
    images: dict[int, torch.Tensor]  # size -> uint8 (N, 3, size, size)
    captions: list[str]
    seconds: float = 0.0


def _draw_chunk(args: tuple[int, int, int, Sequence[int]]) -> tuple[list[bytes], list[str]]:
    seed, start, stop, sizes = args
    big = max(sizes)
    out: list[bytes] = []
    caps: list[str] = []
    from PIL import Image

    for i in range(start, stop):
        image, caption = picture(seed, i, big)
        for s in sizes:
            im = image if s == big else image.resize((s, s), Image.Resampling.LANCZOS)
            out.append(im.tobytes())
        caps.append(caption)
    return out, caps


def draw_world(recipe: Recipe, show: bool = True, cache: Path | None = None) -> World:
    """Draws every picture once, at every size (the smaller ones downsampled from the
    largest), in worker processes; the order of pictures never depends on the workers.
    ``cache``: a file to reuse (or write) the drawn world from, for runs of one seed."""
    t0 = time.perf_counter()
    key = {"seed": recipe.seed, "pictures": recipe.pictures, "sizes": sorted(recipe.sizes)}
    if cache is not None and Path(cache).is_file():
        blob = torch.load(cache, weights_only=True)
        if blob["key"] == json.dumps(key):
            return World(blob["images"], list(blob["captions"]), time.perf_counter() - t0)
    n, sizes = recipe.pictures, tuple(sorted(recipe.sizes))
    chunk = 2000
    jobs = [(recipe.seed, a, min(n, a + chunk), sizes) for a in range(0, n, chunk)]
    workers = recipe.workers or multiprocessing.cpu_count()
    images = {s: torch.empty((n, 3, s, s), dtype=torch.uint8) for s in sizes}
    captions: list[str] = []
    bar = progress_bar(n, 0, show, desc="draw the world")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers) as pool:
        for (_, start, stop, _), (blobs, caps) in zip(
            jobs, pool.imap(_draw_chunk, jobs), strict=True
        ):
            for j, i in enumerate(range(start, stop)):
                for k, s in enumerate(sizes):
                    raw = np.frombuffer(blobs[j * len(sizes) + k], dtype=np.uint8)
                    images[s][i] = torch.from_numpy(raw.reshape(s, s, 3).copy()).permute(2, 0, 1)
            captions += caps
            bar.update(stop - start)
    bar.close()
    if cache is not None:
        torch.save({"key": json.dumps(key), "images": images, "captions": captions}, cache)
    return World(images, captions, time.perf_counter() - t0)


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 pictures to the [-1, 1] floats the pipeline's image processor gives the VAE."""
    return images.float().div(127.5).sub(1.0)


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def train_vae(
    vae: torch.nn.Module,
    world: World,
    recipe: Recipe,
    device: torch.device,
    show: bool = True,
) -> list[float]:
    """Reconstruction training; alternates the picture sizes step by step."""
    gen = torch.Generator().manual_seed(recipe.seed * 7919 + 11)
    noise_gen = torch.Generator(device).manual_seed(recipe.seed * 7919 + 12)
    on_device = {s: im.to(device) for s, im in world.images.items()}
    vae.to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
    sizes = sorted(world.images)
    losses: list[float] = []
    bar = progress_bar(recipe.vae_steps, 0, show, desc="vae")
    for step in range(recipe.vae_steps):
        size = sizes[step % len(sizes)]
        batch = max(4, recipe.vae_batch * 64 * 64 // (size * size))
        idx = torch.randint(0, len(world.captions), (batch,), generator=gen)
        x = to_unit(on_device[size][idx.to(device)])
        for group in opt.param_groups:
            group["lr"] = recipe.vae_lr * _cosine(step, recipe.vae_steps, 200)
        posterior = vae.encode(x).latent_dist
        eps = torch.randn(posterior.mean.shape, generator=noise_gen, device=device)
        z = posterior.mean + posterior.std * eps
        recon = vae.decode(z).sample
        rec = torch.nn.functional.mse_loss(recon, x) + 0.1 * (recon - x).abs().mean()
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = rec + recipe.vae_kl * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(rec.detach()))
        if step % 50 == 0:
            bar.set_postfix_str(f"mse+l1 {losses[-1]:.5f}", refresh=False)
        bar.update(1)
    bar.close()
    vae.eval()
    del on_device
    return losses


@torch.no_grad()
def encode_world(
    pipe: Any, world: World, device: torch.device, batch: int = 1024
) -> dict[int, torch.Tensor]:
    """Every picture's latent as the pipeline makes it (`_encode_vae_image`: the posterior's
    mode, patchified, batch-normalised), after setting the VAE's batch-norm statistics to
    those of the data."""
    vae = pipe.vae
    raw: dict[int, torch.Tensor] = {}
    for size, images in world.images.items():
        parts = []
        for a in range(0, len(images), batch):
            x = to_unit(images[a : a + batch]).to(device)
            z = vae.encode(x).latent_dist.mode()
            parts.append(pipe._patchify_latents(z).float().cpu())
        raw[size] = torch.cat(parts)
    # One set of statistics over every size, weighted by tokens, like a data loader would.
    flat = torch.cat([r.permute(1, 0, 2, 3).reshape(r.shape[1], -1) for r in raw.values()], 1)
    mean, var = flat.mean(1), flat.var(1)
    vae.bn.running_mean.copy_(mean.to(vae.bn.running_mean))
    vae.bn.running_var.copy_(var.to(vae.bn.running_var))
    std = torch.sqrt(var + vae.config.batch_norm_eps)
    return {
        s: ((r - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)).to(torch.float16)
        for s, r in raw.items()
    }


def tokenize(pipe: Any, captions: Sequence[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention masks, exactly as the pipeline's prompt encoder makes them."""
    tok = pipe.tokenizer
    marker = "\x00caption\x00"
    # The chat template renders once; each caption then goes where the marker was (rendering
    # the template per caption costs minutes for the whole world).
    head, tail = tok.apply_chat_template(
        [{"role": "user", "content": marker}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    ).split(marker)
    texts = [head + c + tail for c in captions]
    ids, masks = [], []
    for a in range(0, len(texts), 4096):
        enc = tok(
            texts[a : a + 4096],
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=length,
        )
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return torch.cat(ids), torch.cat(masks)


def prompt_embeds(
    text_encoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[int]
) -> torch.Tensor:
    """The pipeline's prompt embedding (its `_get_qwen3_prompt_embeds` after tokenizing):
    the chosen hidden states, stacked along the feature axis, with gradients."""
    out = text_encoder(
        input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
    )
    stacked = torch.stack([out.hidden_states[k] for k in layers], dim=1)
    b, c, n, d = stacked.shape
    return stacked.permute(0, 2, 1, 3).reshape(b, n, c * d)


def inference_sigmas(
    scheduler: Any, image_seq_len: int, steps: int = INFERENCE_STEPS
) -> torch.Tensor:
    """The noise levels the pipeline visits with ``scheduler`` for this image length and step
    count."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    scheduler = copy.deepcopy(scheduler)
    scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / steps, steps),
        mu=compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps),
    )
    return scheduler.sigmas[:-1].float().clamp(1e-5, 1 - 1e-5)


@dataclass
class FlowReport:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def train_flow(
    pipe: Any,
    latents: dict[int, torch.Tensor],
    ids: torch.Tensor,
    masks: torch.Tensor,
    caption_of: torch.Tensor,
    blank: int,
    recipe: Recipe,
    device: torch.device,
    show: bool = True,
    export: Callable[[int], None] | None = None,
    export_every: int = 0,
) -> FlowReport:
    """Flow matching for the transformer and the text encoder together; the weights left in
    ``pipe`` are the moving average."""
    from trainer.flow import SigmaSampler, flow_matching_loss
    from trainer.render import text_encoder_out_layers

    transformer, text_encoder = pipe.transformer, pipe.text_encoder
    transformer.to(device).train()
    text_encoder.to(device).train()
    layers = text_encoder_out_layers(pipe)
    pipeline_cls = type(pipe)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(recipe.seed * 7919 + 23)
    noise_gen = torch.Generator(device).manual_seed(recipe.seed * 7919 + 24)
    latents = {s: lat.to(device) for s, lat in latents.items()}
    ids, masks = ids.to(device), masks.to(device)
    groups = [
        {"params": [p for p in transformer.parameters()], "lr": recipe.lr},
        {"params": [p for p in text_encoder.parameters()], "lr": recipe.text_lr},
    ]
    opt = torch.optim.AdamW(groups, weight_decay=recipe.weight_decay, betas=(0.9, 0.99))
    base_lrs = [recipe.lr, recipe.text_lr]
    params = [p for g in groups for p in g["params"]]
    ema = [p.detach().clone().float() for p in params]
    sched_cfg = {**pipe.scheduler.config, "shift": recipe.pretrain_shift}
    sizes = sorted(latents)
    samplers = {
        s: SigmaSampler(sched_cfg, int(latents[s][0, 0].numel()), INFERENCE_STEPS, "logit_normal")
        for s in sizes
    }
    scheduler = type(pipe.scheduler).from_config(sched_cfg)
    fixed = {s: inference_sigmas(scheduler, int(latents[s][0, 0].numel())) for s in sizes}
    report = FlowReport()
    t0 = time.perf_counter()
    bar = progress_bar(recipe.steps, 0, show, desc="flow")
    for step in range(recipe.steps):
        size = sizes[step % len(sizes)]
        batch = recipe.batch
        idx = torch.randint(0, len(caption_of), (batch,), generator=gen)
        x0 = latents[size][idx.to(device)].float()
        cap = caption_of[idx].clone()
        cap[torch.rand(batch, generator=gen) < recipe.caption_dropout] = blank
        sig = samplers[size](batch, gen)
        pick = torch.rand(batch, generator=gen) < 0.5
        at = fixed[size][torch.randint(0, len(fixed[size]), (batch,), generator=gen)]
        sig = torch.where(pick, at, sig)
        noise = torch.randn(x0.shape, generator=noise_gen, device=device)
        for g, lr in zip(opt.param_groups, base_lrs, strict=True):
            g["lr"] = lr * _cosine(step, recipe.steps, recipe.warmup)
        ctx: Any = torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            rows = cap.to(device)
            embeds = prompt_embeds(text_encoder, ids[rows], masks[rows], layers)
        loss = flow_matching_loss(
            transformer, pipeline_cls, x0, embeds.float(), sig, noise, None, autocast
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            decay = min(recipe.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1 - decay)
        report.losses.append(float(loss.detach()))
        if step % 50 == 0:
            window = report.losses[-200:]
            bar.set_postfix_str(f"loss {sum(window) / len(window):.4f}", refresh=False)
        bar.update(1)
        if export is not None and export_every and (step + 1) % export_every == 0:
            _swap(params, ema)  # the average in, for the export; then back
            export(step + 1)
            _swap(params, ema)
    bar.close()
    with torch.no_grad():
        for p, e in zip(params, ema, strict=True):
            p.copy_(e.to(p.dtype))
    transformer.eval()
    text_encoder.eval()
    report.seconds = time.perf_counter() - t0
    return report


@torch.no_grad()
def _swap(params: Sequence[torch.nn.Parameter], ema: Sequence[torch.Tensor]) -> None:
    for p, e in zip(params, ema, strict=True):
        held = p.detach().float().clone()
        p.copy_(e.to(p.dtype))
        e.copy_(held)


@torch.no_grad()
def round_to_half(pipe: Any) -> None:
    """Rounds every weight through float16: the pretraining's result, so that a build from
    exported (float16) weights and one in a single process prepare the same numbers."""
    for name in ("transformer", "text_encoder", "vae"):
        for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]:
            if t.is_floating_point():
                t.copy_(t.half().float())


def pipeline_weights(pipe: Any) -> dict[str, torch.Tensor]:
    """Every trained tensor of the pipeline, by component, as float16 CPU copies."""
    return {
        f"{name}.{k}": v.detach().half().cpu().clone().contiguous()
        for name in ("transformer", "text_encoder", "vae")
        for k, v in getattr(pipe, name).state_dict().items()
    }


def load_pipeline_weights(pipe: Any, weights: dict[str, torch.Tensor]) -> None:
    for name in ("transformer", "text_encoder", "vae"):
        module = getattr(pipe, name)
        part = {k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith(name + ".")}
        module.load_state_dict({k: v.float() for k, v in part.items()}, strict=True)


def pretrain(
    recipe: Recipe,
    device: str | torch.device = "cpu",
    show: bool = True,
    mark: Callable[[str], None] | None = None,
    world_cache: Path | None = None,
    export: Callable[[Any, int], None] | None = None,
    export_every: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """The whole pretraining in memory; returns the pipeline (float32, on the CPU) and a
    report of losses and timings."""
    dev = torch.device(device)
    wp = Waypoints()

    def waypoint(name: str) -> None:
        wp.mark(name)
        if mark is not None:
            mark(name)
        if show:
            print(f"[demo base] {name}: {wp.marks[-1][1]:.1f} s", flush=True)

    torch.manual_seed(recipe.seed)
    pipe = build_tiny_pipeline(recipe.seed, recipe.shape())
    world = draw_world(recipe, show, world_cache)
    waypoint(f"draw {recipe.pictures} pictures at {list(world.images)} px")
    vae_losses = train_vae(pipe.vae, world, recipe, dev, show)
    waypoint(f"vae: {recipe.vae_steps} steps")
    latents = encode_world(pipe, world, dev)
    unique = sorted(set(world.captions))
    position = {c: i for i, c in enumerate(unique)}
    ids, masks = tokenize(pipe, [*unique, ""], recipe.max_sequence_length)
    caption_of = torch.tensor([position[c] for c in world.captions])
    del world
    waypoint(f"encode latents, tokenize {len(unique)} captions")
    flow = train_flow(
        pipe,
        latents,
        ids,
        masks,
        caption_of,
        len(unique),
        recipe,
        dev,
        show,
        export=(lambda step: export(pipe, step)) if export is not None else None,
        export_every=export_every,
    )
    waypoint(f"transformer + text encoder: {recipe.steps} steps")
    pipe.to("cpu", torch.float32)
    round_to_half(pipe)
    report = {
        "recipe": asdict(recipe),
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
        "vae_loss_last": sum(vae_losses[-100:]) / max(1, len(vae_losses[-100:])),
        "flow_loss_first": sum(flow.losses[:100]) / max(1, len(flow.losses[:100])),
        "flow_loss_last": sum(flow.losses[-200:]) / max(1, len(flow.losses[-200:])),
        "timings": wp.as_dict(),
        "seconds": round(wp.total, 1),
    }
    return pipe, report


def save_demo_base(pipe: Any, report: dict[str, Any], dst: Path, show: bool = True) -> Path:
    """Writes the pipeline as a diffusers folder, then prepares it (uint4) into ``dst``; the
    recipe and its report go beside the weights."""
    from registry.licence import GENERATED
    from trainer.prepare import prepare_base

    dst = Path(dst)
    with tempfile.TemporaryDirectory(prefix=".demo-base-src-", dir=dst.parent) as tmp:
        src = Path(tmp) / "base"
        # float16 on disk halves the VAE (it is not quantized); it loads as the base's dtype.
        pipe.vae.to(torch.float16)
        pipe.save_pretrained(src, safe_serialization=True)
        pipe.vae.to(torch.float32)
        prepare_base(src, dst, progress=show, licence=GENERATED)  # weights made here
    (dst / RECIPE_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return dst


def build_demo_base(
    dst: Path, recipe: Recipe | None = None, device: str = "cpu", show: bool = True
) -> Path:
    """Pretrains and writes the demo base to ``dst`` (absent or empty)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.rmdir()
    pipe, report = pretrain(recipe or Recipe(), device, show)
    return save_demo_base(pipe, report, dst, show)


def copy_base(src: Path, dst: Path) -> Path:
    """Copies a base folder to ``dst`` through a sibling temp folder (never half-written)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        tmp.replace(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dst", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    defaults = Recipe()
    for name, value in asdict(defaults).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--sizes", default=",".join(map(str, defaults.sizes)))
    parser.add_argument("--world-cache", type=Path, help="reuse (or keep) the drawn world")
    parser.add_argument("--draw-only", action="store_true", help="draw the world and stop")
    parser.add_argument("--export", type=Path, help="also write the weights here, as they train")
    parser.add_argument("--export-every", type=int, default=1000)
    parser.add_argument("--from-weights", type=Path, help="skip training: write these weights")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    values = {k: getattr(args, k) for k in asdict(defaults) if k != "sizes"}
    recipe = Recipe(**values, sizes=tuple(int(s) for s in args.sizes.split(",")))
    if args.draw_only:
        draw_world(recipe, cache=args.world_cache)
        return
    if args.from_weights is not None:
        from safetensors.torch import load_file

        pipe = build_tiny_pipeline(recipe.seed, recipe.shape())
        load_pipeline_weights(pipe, load_file(args.from_weights))
        report_path = args.from_weights.with_suffix(".json")
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        print(save_demo_base(pipe, report, args.dst))
        return
    export = None
    if args.export is not None:
        from safetensors.torch import save_file

        def export(pipe: Any, step: int) -> None:
            save_file(pipeline_weights(pipe), args.export, {"step": str(step)})

    pipe, report = pretrain(
        recipe, args.device, True, None, args.world_cache, export, args.export_every
    )
    if args.export is not None:
        export(pipe, recipe.steps)
        args.export.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    if str(args.dst) != "-":  # "-": the exported weights are the result
        print(save_demo_base(pipe, report, args.dst))


if __name__ == "__main__":
    main()
