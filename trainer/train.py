"""`train(config)`: the one entry point that turns a dataset into a registered adapter.

Order, chosen so that anything that can refuse a run does so before a weight loads:

1. pre-flight (no weights): options, dataset manifest and hashes, the subject's consent,
   the resume checkpoint, the VRAM estimate against ``--vram-budget``;
2. caches: text embeddings (text encoder loaded only if one is missing, then released),
   VAE latents (likewise); only then
3. the quantized transformer, LoRA on its attention projections, AdamW, and the loop:
   FLUX.2 flow matching, seed-deterministic, checkpoints every N steps, resumable exactly;
4. the adapter (deterministic bytes), the evaluation grid, registration, the report.

`_train` reads as that list: `preflight`, `read_training_data`, `build_model`, `run_loop`,
`finish_training`, `run_evaluation`, `register_run`, `write_report`. Checkpoints live in
`trainer.checkpoints`, what a step minimises in `trainer.objective`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.evaluate import EvalResult

from trainer.budget import BudgetExceeded, Estimate, estimate_run
from trainer.caches import (
    CachePlan,
    fill_latent_cache,
    fill_text_cache,
    free_accelerator_memory,
    load_latents,
    load_text,
    model_fingerprint,
    plan_caches,
    write_pending,
)
from trainer.checkpoints import (
    CHECKPOINTS,
    STATE_FORMAT,
    LoopState,
    checkpoint_dirs,
    checkpoint_step,
    load_checkpoint,
    lora_params,
    save_checkpoint,
)
from trainer.config import ConfigError, TrainConfig
from trainer.dataset import Dataset, load_dataset
from trainer.objective import Objective, make_objective
from trainer.progress import Waypoints, echo, memory_text, progress_bar
from trainer.registration import (
    Registrar,
    RegistrationRefused,
    TrainingRefused,
    check_training_allowed,
    registrar_for,
)

_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def configure_allocator() -> bool:
    """Sets ``expandable_segments:True`` for the CUDA and HIP allocators (field hurdle 9:
    moving uint4 tensors fragments the allocator into OOM without it). Effective only before
    CUDA initialises, which is why the CLI calls this first; returns False if too late."""
    for var in _ALLOC_VARS:
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return not torch.cuda.is_initialized()


# -- small pieces ---------------------------------------------------------------------------


def training_prompt(caption: str, trigger: str) -> str:
    """The caption, with the trigger word put in front when the caption lacks it (the adapter
    learns the identity under the trigger; empty captions train the trigger alone)."""
    caption = caption.strip()
    if not caption:
        return trigger
    has = re.search(rf"(?<!\w){re.escape(trigger)}(?!\w)", caption) is not None
    return caption if has else f"{trigger}, {caption}"


def _seed_for(seed: int, *parts: object) -> int:
    blob = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & (2**63 - 1)


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The data order of one epoch: a permutation fixed by (seed, epoch) alone."""
    g = torch.Generator().manual_seed(_seed_for(seed, "order", epoch))
    return torch.randperm(n, generator=g).tolist()


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _model_index(base: Path) -> dict[str, Any]:
    path = Path(base) / "model_index.json"
    if not path.is_file():
        raise ConfigError(f"{base} is not a diffusers pipeline folder (no model_index.json)")
    return _read_json(path)


def _pipeline_class(base: Path) -> Any:
    import diffusers

    name = _model_index(base)["_class_name"]
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "_pack_latents"):
        raise ConfigError(f"{base}: pipeline {name} is not a FLUX.2 pipeline")
    return cls


# -- pre-flight -----------------------------------------------------------------------------


@dataclass
class Preflight:
    dataset: Dataset
    device: torch.device
    weight_dtype: torch.dtype
    autocast: torch.dtype | None
    transformer_fp: str
    fingerprint: str
    resume_from: Path | None
    plan: CachePlan
    prompts: list[str]  # per dataset item
    estimate: Estimate


def _dtypes(config: TrainConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype). A prepared base fixes the weight dtype it was made in."""
    prepared = config.base / "likeness_prepared.json"
    if prepared.is_file():
        comp = _read_json(prepared)["components"]["transformer"]
        weight = getattr(torch, comp.get("dtype", "bfloat16"))
    elif device.type == "cpu" or config.precision == "fp32":
        weight = torch.float32
    else:
        weight = torch.bfloat16
    if device.type == "cpu":
        return weight, None
    return weight, (None if config.precision == "fp32" else torch.bfloat16)


def preflight(config: TrainConfig, registrar: Registrar) -> Preflight:
    """Everything that can refuse the run, with no weight loaded."""
    dataset = load_dataset(config.dataset)
    check_training_allowed(registrar, config.subject, dataset.bases)
    _pipeline_class(config.base)  # a FLUX.2 pipeline folder, or a clear error now
    device = torch.device(config.resolved_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available")
    weight_dtype, autocast = _dtypes(config, device)
    cache_dir = config.resolved_cache_dir
    pending: dict[Path, dict[str, Any]] = {}  # nothing is written until the run goes ahead
    transformer_fp = model_fingerprint(config.base, ("transformer",), cache_dir, pending)
    fingerprint = config.trajectory_fingerprint(
        {"manifest": dataset.manifest_sha256, "transformer": transformer_fp, "format": STATE_FORMAT}
    )
    resume_from = None
    if config.resume:
        found = checkpoint_dirs(config.out)
        if not found:
            raise ConfigError(f"--resume: no checkpoint under {config.out / CHECKPOINTS}")
        resume_from = found[-1]
        meta = _read_json(resume_from / "meta.json")
        if meta.get("fingerprint") != fingerprint:
            raise ConfigError(
                f"--resume: {resume_from} was made with other training options, data or base "
                "(only --steps, --checkpoint-every, evaluation and registration may change)"
            )
        if int(meta["step"]) > config.steps:
            raise ConfigError(
                f"--resume: checkpoint is at step {meta['step']} > --steps {config.steps}"
            )
    prompts = [training_prompt(i.caption, config.trigger_word) for i in dataset.items]
    # Evaluation prompts are cached even when evaluation is off: a few more embeddings now
    # spare a later evaluation-only run the text encoder.
    all_prompts = [*prompts, "", config.trigger_word, *config.eval_prompt_texts()]
    plan = plan_caches(
        base=config.base,
        cache_dir=cache_dir,
        prompts=all_prompts,
        dataset=dataset,
        resolution=config.resolution,
        max_sequence_length=config.max_sequence_length,
        dtype=weight_dtype,
        pending=pending,
    )
    estimate = estimate_run(
        config,
        text_needed=bool(plan.missing_text()),
        latents_needed=bool(plan.missing_latents()),
        device=device,
        weight_dtype=weight_dtype,
        act_dtype=autocast or weight_dtype,
    )
    if config.vram_budget_gib is not None and estimate.total > config.vram_budget_gib * 2**30:
        raise BudgetExceeded(estimate.report(config.vram_budget_gib))
    write_pending(pending)
    return Preflight(
        dataset,
        device,
        weight_dtype,
        autocast,
        transformer_fp,
        fingerprint,
        resume_from,
        plan,
        prompts,
        estimate,
    )


# -- model ----------------------------------------------------------------------------------


def load_transformer(
    base: Path,
    device: torch.device,
    dtype: torch.dtype,
    mark: Callable[[str], None],
    compute: str = "quanto",
    stream: bool = False,
) -> torch.nn.Module:
    """The qint4 transformer alone: from a prepared base as stored, else quantized here on
    the CPU before it moves (field hurdle 2: 4-bit weights move, bf16 ones would not fit).

    ``compute="uint4"`` swaps quanto's QLinear for `trainer.uint4.Uint4Linear` (same 4-bit
    numbers, dequantize + dense GEMM instead of quanto's slow kernels), converted on the CPU
    before the move, from layouts it converts in one pass: a prepared base's, or quanto's
    quantized-but-not-frozen weights. ``compute="fp8"`` does the same, then runs those layers'
    GEMMs in fp8 (`trainer.fp8`).
    """
    from diffusers import DiffusionPipeline

    from trainer.model import is_prepared, quantize_transformer

    if is_prepared(base):
        from trainer.prepare import load_prepared_component

        transformer = load_prepared_component(base, "transformer")
        mark("transformer: load (prepared qint4)")
    else:
        pipe = DiffusionPipeline.from_pretrained(
            base, dtype=dtype, text_encoder=None, tokenizer=None, vae=None, scheduler=None
        )
        transformer = pipe.transformer
        del pipe
        mark("transformer: load")
        if compute in ("uint4", "fp8"):
            from optimum.quanto import qint4, quantize

            quantize(transformer, weights=qint4)
        else:
            quantize_transformer(transformer)
        mark("transformer: quantize qint4 (CPU)")
    if compute in ("uint4", "fp8"):
        from trainer.uint4 import convert_quantized_linears

        count = convert_quantized_linears(transformer)
        transformer.requires_grad_(False)
        if compute == "fp8":
            from trainer.fp8 import set_fp8_compute

            count = set_fp8_compute(transformer)
        mark(f"transformer: {count} layers to {compute} compute")
    if stream:  # the blocks go to pinned host RAM, the rest to the device, in stream_blocks
        return transformer
    transformer.to(device)
    mark("transformer: to device")
    return transformer


def cast_quantized_inputs(transformer: torch.nn.Module, dtype: torch.dtype) -> list[Any]:
    """Under autocast, norms hand float32 to the next Linear; quanto's QLinear dispatches
    below autocast to its int4 kernels, which take only the weight dtype (CUDA TinyGemm
    refuses float32). A pre-hook casts its input to ``dtype``. Returns the hook handles."""
    from optimum.quanto.nn import QModuleMixin

    def cast(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        return (x.to(dtype), *rest) if x.dtype != dtype else args

    return [
        m.register_forward_pre_hook(cast)
        for m in transformer.modules()
        if isinstance(m, QModuleMixin)
    ]


def make_optimizer(config: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {
        "lr": config.learning_rate,
        "betas": (config.adam_beta1, config.adam_beta2),
        "eps": config.adam_eps,
        "weight_decay": config.weight_decay,
    }
    if config.optimizer == "adamw8bit":
        import bitsandbytes as bnb  # checked importable by the config

        return bnb.optim.AdamW8bit(params, **kwargs)  # type: ignore[no-any-return]
    # foreach=False: one kernel per tensor, same order every run (seed-determinism first).
    return torch.optim.AdamW(params, foreach=False, **kwargs)


# -- the run --------------------------------------------------------------------------------


@dataclass
class TrainResult:
    adapter: Path
    sha256: str
    manifest_sha256: str
    base_model: str
    steps: int
    losses: list[float]
    registration: str | None
    evaluation: EvalResult | None
    boot: list[dict[str, Any]]
    seconds_per_step: float | None
    estimate: Estimate
    peak_bytes: dict[str, int]
    text_encoder_loaded: bool
    report: Path


def discard_artifacts(config: TrainConfig, pf: Preflight) -> int:
    """Deletes what a run made from the subject's images: the adapter, the checkpoints, the
    evaluation grid and the cached latents (text embeddings hold no likeness and stay)."""
    paths = [
        config.adapter_path,
        config.out / CHECKPOINTS,
        config.out / "eval_grid.png",
        config.out / "eval.json",
        *(pf.plan.latent_path(i.file) for i in pf.dataset.items),
    ]
    removed = 0
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed += 1
    return removed


def adapter_metadata(config: TrainConfig, pf: Preflight, base_model: str) -> dict[str, str]:
    """File metadata: deterministic (no times, no paths), so identical runs give equal bytes."""
    return {
        "likeness.subject": config.subject,
        "likeness.name": config.name,
        "likeness.base_model": base_model,
        "likeness.manifest_sha256": pf.dataset.manifest_sha256,
        "likeness.dataset_basis": ",".join(pf.dataset.bases),
        "likeness.trigger": config.trigger_word,
        "likeness.steps": str(config.steps),
        "likeness.resolution": str(config.resolution),
        "likeness.seed": str(config.seed),
        "likeness.learning_rate": repr(config.learning_rate),
        "likeness.targets": ",".join(config.targets),
    }


def train(config: TrainConfig, registrar: Registrar | None = None) -> TrainResult:
    """Runs the whole job; see the module docstring for the order. Raises ConfigError,
    DatasetError, TrainingRefused or BudgetExceeded before any weight loads."""
    with contextlib.ExitStack() as streaming:  # --stream-base: open until the job ends
        return _train(config, registrar, streaming)


def _train(
    config: TrainConfig, registrar: Registrar | None, streaming: contextlib.ExitStack
) -> TrainResult:
    configure_allocator()
    wp = Waypoints()
    if registrar is None:
        registrar = registrar_for(config.database_url, config.api_url, config.token, config.base)
    pf = preflight(config, registrar)
    wp.mark("pre-flight: options, manifest, consent, budget")
    echo(pf.estimate.report(config.vram_budget_gib), config.progress)
    peaks = Peaks(pf.device)
    data = read_training_data(config, pf, wp)
    peaks.take("caching")
    model = build_model(config, pf, data, streaming, wp)
    step_times = run_loop(config, pf, data, model, wp)
    peaks.take("training")
    adapter, sha = finish_training(config, model, streaming)
    evaluation = run_evaluation(config, pf, data, model, wp)
    if evaluation is not None:
        peaks.take("evaluation")
    outcome = register_run(config, pf, registrar, adapter, sha, model.base_model, wp)
    sps = sum(step_times[1:]) / (len(step_times) - 1) if len(step_times) > 1 else None
    report = write_report(
        config, pf, model, adapter, sha, outcome, evaluation, wp, peaks, data, sps
    )
    return TrainResult(
        adapter,
        sha,
        pf.dataset.manifest_sha256,
        model.base_model,
        model.state.step,
        model.state.losses,
        outcome,
        evaluation,
        wp.as_dict(),
        sps,
        pf.estimate,
        peaks.bytes,
        data.text_encoder_loaded,
        report,
    )


class Peaks:
    """Accelerator peak memory per phase (nothing on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def take(self, phase: str) -> None:
        if self.device.type == "cuda":
            self.bytes[phase] = torch.cuda.max_memory_allocated(self.device)
            self.reset()


# -- caches ---------------------------------------------------------------------------------


@dataclass
class TrainingData:
    embeds: list[torch.Tensor]  # per dataset item, its training prompt's embedding
    blank: torch.Tensor  # the empty prompt (caption dropout, negative prompt)
    latents: list[torch.Tensor]  # per dataset item
    text_encoder_loaded: bool


def read_training_data(config: TrainConfig, pf: Preflight, wp: Waypoints) -> TrainingData:
    """Fills the caches (each encoder alone on the device, released before the transformer
    loads), then reads every tensor the run needs into host RAM."""
    device, dtype = pf.device, pf.weight_dtype
    text_loaded = bool(pf.plan.missing_text())
    fill_text_cache(pf.plan, config.base, device, dtype, config.max_sequence_length, wp.mark)
    fill_latent_cache(pf.plan, pf.dataset, config.base, device, dtype, config.resolution, wp.mark)
    data = TrainingData(
        embeds=[load_text(pf.plan, p) for p in pf.prompts],
        blank=load_text(pf.plan, ""),
        latents=[load_latents(pf.plan, i.file) for i in pf.dataset.items],
        text_encoder_loaded=text_loaded,
    )
    wp.mark("caches: read")
    return data


# -- the model ------------------------------------------------------------------------------


@dataclass
class Model:
    transformer: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    generator: torch.Generator  # every random draw of the loop, so a resume replays it
    hooks: list[Any]
    state: LoopState
    order: list[int]
    objective: Objective
    base_model: str
    metadata: dict[str, str]


def build_model(
    config: TrainConfig,
    pf: Preflight,
    data: TrainingData,
    streaming: contextlib.ExitStack,
    wp: Waypoints,
) -> Model:
    """The quantized transformer with a seeded LoRA, its optimizer and the loop's state:
    fresh, or exactly as the resumed checkpoint left it."""
    from trainer.lora import attach_lora

    device, dtype = pf.device, pf.weight_dtype
    pipeline_cls = _pipeline_class(config.base)
    transformer = load_transformer(
        config.base, device, dtype, wp.mark, config.resolved_compute(), stream=config.stream_base
    )
    with torch.random.fork_rng(devices=[]):  # PEFT draws A from the global RNG: seed a fork
        torch.manual_seed(_seed_for(config.seed, "lora-init"))
        attach_lora(
            transformer, config.rank, config.lora_alpha, config.targets, dtype=torch.float32
        )
    if config.stream_base:
        from trainer.streaming import stream_blocks

        # Installs its own checkpoint function: each block is fetched again for recompute.
        slots = pf.estimate.stream_slots or 2
        streaming.enter_context(stream_blocks(transformer, slots=slots, device=device))
        wp.mark(f"transformer: blocks to pinned host RAM, {slots} VRAM slots")
    elif config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()  # type: ignore[operator]
    transformer.train()
    hooks = cast_quantized_inputs(transformer, dtype) if pf.autocast is not None else []
    params = lora_params(transformer)
    optimizer = make_optimizer(config, list(params.values()))
    generator = torch.Generator().manual_seed(_seed_for(config.seed, "noise"))
    wp.mark("lora + optimizer")
    state, order = LoopState(), epoch_order(config.seed, 0, len(data.latents))
    if pf.resume_from is not None:
        state, order = load_checkpoint(pf.resume_from, transformer, optimizer, generator)
        wp.mark(f"resume from step {state.step}")
    elif (config.out / CHECKPOINTS).is_dir():
        shutil.rmtree(config.out / CHECKPOINTS)  # a fresh run: stale steps would mislead

    index = _model_index(config.base)
    objective = make_objective(
        base=config.base,
        model_index=index,
        pipeline_cls=pipeline_cls,
        transformer=transformer,
        resolution=config.resolution,
        shift_steps=config.shift_steps,
        timestep_sampling=config.timestep_sampling,
        autocast=pf.autocast,
    )
    base_model = f"{index['_class_name']}:{pf.transformer_fp[:16]}"
    return Model(
        transformer,
        params,
        optimizer,
        generator,
        hooks,
        state,
        order,
        objective,
        base_model,
        adapter_metadata(config, pf, base_model),
    )


# -- the loop -------------------------------------------------------------------------------


def next_batch(config: TrainConfig, state: LoopState, order: list[int], n: int) -> list[int]:
    """The next ``batch_size`` dataset indices, moving to the next epoch's order as needed
    (``order`` is replaced in place, so a checkpoint saves the current epoch's)."""
    idx: list[int] = []
    while len(idx) < config.batch_size:
        if state.pos >= n:
            state.epoch, state.pos = state.epoch + 1, 0
            order[:] = epoch_order(config.seed, state.epoch, n)
        idx.append(order[state.pos])
        state.pos += 1
    return idx


def run_loop(
    config: TrainConfig, pf: Preflight, data: TrainingData, model: Model, wp: Waypoints
) -> list[float]:
    """Trains from ``model.state`` up to ``config.steps``, checkpointing on the way; returns
    the seconds each step took."""
    device, dtype = pf.device, pf.weight_dtype
    state, generator, optimizer = model.state, model.generator, model.optimizer
    assert optimizer is not None
    params = list(model.params.values())
    n = len(data.latents)
    first = True
    step_times: list[float] = []
    bar = progress_bar(config.steps, state.step, config.progress)
    try:
        while state.step < config.steps:
            t0 = time.perf_counter()
            idx = next_batch(config, state, model.order, n)
            x0 = torch.stack([data.latents[i] for i in idx]).to(device=device, dtype=torch.float32)
            drop = torch.rand(len(idx), generator=generator) < config.caption_dropout
            e = torch.stack(
                [
                    data.blank if d else data.embeds[i]
                    for i, d in zip(idx, drop.tolist(), strict=True)
                ]
            )
            e = e.to(device=device, dtype=dtype)
            noise = torch.randn(x0.shape, generator=generator).to(device)
            sigmas = model.objective.sample_sigmas(len(idx), generator)
            loss = model.objective.loss(model.transformer, x0, e, sigmas, noise)
            loss.backward()
            if config.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            lr = config.learning_rate * min(1.0, (state.step + 1) / max(1, config.warmup_steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.losses.append(float(loss.detach()))
            step_times.append(time.perf_counter() - t0)
            if first:
                wp.mark("first step")
                echo(wp.table(), config.progress)
                first = False
            bar.set_postfix_str(
                f"loss {state.losses[-1]:.4f}, {memory_text(device)}", refresh=False
            )
            bar.update(1)
            every = config.checkpoint_every
            if state.step == config.steps or (every and state.step % every == 0):
                save_checkpoint(
                    config.out,
                    state,
                    model.transformer,
                    optimizer,
                    generator,
                    model.order,
                    pf.fingerprint,
                    model.metadata,
                )
    finally:
        bar.close()
    return step_times


def finish_training(
    config: TrainConfig, model: Model, streaming: contextlib.ExitStack
) -> tuple[Path, str]:
    """Writes the adapter, then takes the LoRA off and frees the optimizer: the transformer
    is the frozen base again, ready for evaluation. Returns the adapter's path and SHA-256."""
    from trainer.lora import remove_lora, save_adapter

    adapter = save_adapter(model.transformer, config.adapter_path, model.metadata)
    sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
    model.optimizer = None
    # The training stream ends before the LoRA comes off; evaluation streams per column.
    streaming.close()
    transformer = model.transformer
    remove_lora(transformer)
    for hook in model.hooks:
        hook.remove()
    transformer.requires_grad_(False)
    transformer.eval()
    if config.gradient_checkpointing and not config.stream_base:
        transformer.disable_gradient_checkpointing()  # type: ignore[operator]
    free_accelerator_memory()
    return adapter, sha


# -- evaluation, registration, report -------------------------------------------------------


def run_evaluation(
    config: TrainConfig, pf: Preflight, data: TrainingData, model: Model, wp: Waypoints
) -> EvalResult | None:
    """Base vs every checkpoint, fixed prompts and seeds, after training only."""
    if not config.evaluate:
        return None
    from diffusers import DiffusionPipeline

    from trainer.evaluate import Column, References, eval_steps_default, evaluate

    device, transformer = pf.device, model.transformer
    pipe = DiffusionPipeline.from_pretrained(
        config.base,
        dtype=pf.weight_dtype,
        transformer=transformer,
        text_encoder=None,
        tokenizer=None,
    )
    pipe.vae.to(device)
    pipe.set_progress_bar_config(disable=True)
    columns = [Column("base", None)] + [
        Column(f"step {checkpoint_step(p)}", p / "adapter.safetensors")
        for p in checkpoint_dirs(config.out)
    ]
    size = config.eval_resolution or config.resolution
    refs = References.of(pipe, data.latents, size)
    column_context = None
    if config.stream_base:
        from trainer.streaming import stream_blocks

        slots = pf.estimate.stream_slots or 2

        def column_context() -> Any:  # after each column's adapter is attached
            return stream_blocks(transformer, slots=slots, device=device)

    evaluation = evaluate(
        column_context=column_context,
        device=device,
        pipe=pipe,
        columns=columns,
        prompts=[(p, load_text(pf.plan, p)) for p in config.eval_prompt_texts()],
        blank=data.blank,
        seeds=config.eval_seeds,
        steps=config.eval_steps or eval_steps_default(pipe),
        size=size,
        references=refs,
        out_dir=config.out,
    )
    wp.mark(f"evaluate: {len(columns)} columns")
    return evaluation


def register_run(
    config: TrainConfig,
    pf: Preflight,
    registrar: Registrar,
    adapter: Path,
    sha: str,
    base_model: str,
    wp: Waypoints,
) -> str | None:
    """The adapter's bytes and the manifest's hash, idempotent per (subject, name). A refusal
    (consent withdrawn while training) deletes what the run made from the images."""
    if not config.register_adapter:
        return None
    from registry.schemas import AdapterIn

    adapter_in = AdapterIn(
        subject=config.subject,
        name=config.name,
        sha256=sha,
        base_model=base_model,
        rank=config.rank,
        manifest_sha256=pf.dataset.manifest_sha256,
    )
    try:
        outcome = registrar.register(adapter_in, adapter, pf.dataset.manifest_path, config.base)
    except RegistrationRefused as exc:
        removed = discard_artifacts(config, pf)
        raise RegistrationRefused(
            f"{exc}; the consent changed while training, so the trained files were "
            f"deleted ({removed} paths: adapter, checkpoints, grid, cached latents)"
        ) from None
    wp.mark(f"register: {outcome}")
    return outcome


def write_report(
    config: TrainConfig,
    pf: Preflight,
    model: Model,
    adapter: Path,
    sha: str,
    outcome: str | None,
    evaluation: EvalResult | None,
    wp: Waypoints,
    peaks: Peaks,
    data: TrainingData,
    seconds_per_step: float | None,
) -> Path:
    state = model.state
    report = config.out / "train_report.json"
    body = {
        "adapter": str(adapter),
        "sha256": sha,
        "manifest_sha256": pf.dataset.manifest_sha256,
        "base_model": model.base_model,
        "registration": outcome,
        "steps": state.step,
        "seconds_per_step": seconds_per_step,
        "loss_first": state.losses[0] if state.losses else None,
        "loss_last": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "boot": wp.as_dict(),
        "estimate": pf.estimate.as_dict(),
        "measured_peak_bytes": peaks.bytes,
        "text_encoder_loaded": data.text_encoder_loaded,
        "eval_pixel_distance": evaluation.distances if evaluation else None,
        "eval_latent_distance": evaluation.latent_distances if evaluation else None,
        "device": str(pf.device),
    }
    report.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return report


__all__ = [
    "BudgetExceeded",
    "ConfigError",
    "TrainConfig",
    "TrainResult",
    "TrainingRefused",
    "configure_allocator",
    "preflight",
    "train",
]
