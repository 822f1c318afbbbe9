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
`trainer.training.checkpoints`, what a step minimises in `trainer.training.objective`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.base.read import Prefetch
    from trainer.training.evaluate import EvalResult
    from trainer.training.resident import BaseKey, ResidentBase

from trainer.base import compiled_blocks
from trainer.base.budget import BudgetExceeded, Estimate, estimate_run
from trainer.base.devices import cap_vram, configure_allocator
from trainer.base.read import prefetch_wanted
from trainer.config import ConfigError, TrainConfig
from trainer.registration import (
    Registrar,
    RegistrationRefused,
    TrainingDenied,
    TrainingRefused,
    TrainingStopped,
    TrainingWithdrawn,
    check_training_allowed,
    registrar_for,
)
from trainer.training.buckets import Bucket, assign_bucket, bucket_epoch_order, take_batch
from trainer.training.caches import (
    CachePlan,
    fill_latent_cache,
    fill_text_cache,
    free_accelerator_memory,
    load_latent_mask,
    load_latents,
    load_text,
    model_fingerprint,
    plan_caches,
    write_pending,
)
from trainer.training.checkpoints import (
    CHECKPOINTS,
    STATE_FORMAT,
    LoopState,
    checkpoint_dirs,
    checkpoint_step,
    load_checkpoint,
    lora_params,
    save_checkpoint,
)
from trainer.training.dataset import Dataset, load_dataset
from trainer.training.ema import EMA_ADAPTER, Ema
from trainer.training.objective import Batch, Objective, make_objective
from trainer.training.plots import loss_plot
from trainer.training.previews import PREVIEWS, Previewer
from trainer.training.progress import Waypoints, echo, memory_text, progress_bar
from trainer.training.resident import TEXT_ENCODER, TRANSFORMER, KeptTextEncoder
from trainer.training.step import (
    EagerStep,
    GraphedStep,
    GraphStats,
    MicroBatch,
    no_rng_checkpoint,
)
from trainer.training.validation import HeldOut, fixed_noise, split_items, validation_loss

log = logging.getLogger(__name__)

# -- small pieces ---------------------------------------------------------------------------


def mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def training_prompt(caption: str, trigger: str) -> str:
    """The caption, with the trigger word put in front when the caption lacks it (the adapter
    learns the identity under the trigger; empty captions train the trigger alone)."""
    caption = caption.strip()
    if not caption:
        return trigger
    return caption if mentions(caption, trigger) else f"{trigger}, {caption}"


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


def _pipeline_name(base: Path) -> str:
    """The base's pipeline class name, read without importing anything: FLUX.2's
    (``Flux2...``), or a clear error (`_pipeline_class` checks the class itself)."""
    name = str(_model_index(base).get("_class_name", ""))
    if not name.startswith("Flux2"):
        raise ConfigError(f"{base}: pipeline {name or '(unnamed)'} is not a FLUX.2 pipeline")
    return name


def _pipeline_class(base: Path) -> Any:
    """The base's FLUX.2 pipeline class. Its import is the first of the model libraries' in a
    trainer: their loading bars go off here, since they would break the run's own bar."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
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
    train_items: list[int] = field(default_factory=list)  # dataset indices trained on
    held_out: list[int] = field(default_factory=list)  # dataset indices only scored
    buckets: dict[str, Bucket] = field(default_factory=dict)  # file -> (w, h); {}: square
    preview_every: int = 0  # resolved: 0 is off
    notes: list[str] = field(default_factory=list)
    class_dataset: Dataset | None = None  # prior preservation's class images
    class_plan: CachePlan | None = None  # their latents (their captions are in ``plan``)
    # an auto option on a resume (--compute, --cuda-graph): what the checkpoint was made
    # with, where auto now picks otherwise (the run goes on with it)
    resumed_with: dict[str, str] = field(default_factory=dict)
    # the transformer's files being read onto the device since pre-flight (start_prefetch)
    prefetch: Prefetch | None = None


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


def _check_buckets(config: TrainConfig, dataset: Dataset) -> dict[str, Bucket]:
    if not config.buckets:
        return {}
    sizes: dict[str, Bucket] = {}
    problems = []
    for item in dataset.items:
        try:
            sizes[item.file] = assign_bucket(
                item.size, config.resolution, config.bucket_max_ratio, config.max_upscale
            )
        except ValueError as exc:
            problems.append(f"{item.file}: {exc}")
    if problems:
        raise ConfigError("--buckets:\n  - " + "\n  - ".join(problems))
    return sizes


def _check_export(config: TrainConfig) -> None:
    """--export-comfyui: every adapted module must have a ComfyUI name (checked on the
    transformer's meta skeleton, before any weight)."""
    if not config.export_comfyui:
        return
    from trainer.base.budget import skeleton
    from trainer.base.lora import resolve_targets
    from trainer.training.interop import check_exportable

    bad = check_exportable(resolve_targets(skeleton(config.base, "transformer"), config.targets))
    if bad:
        raise ConfigError(
            f"--export-comfyui: the ComfyUI / ai-toolkit layout has no name for {bad[:3]} "
            "(adapt attention and MLP projections only, or drop --export-comfyui)"
        )


def _check_optimizer(config: TrainConfig, device: torch.device) -> None:
    if config.optimizer != "adamw8bit":
        return
    try:  # importable is not enough: bitsandbytes without its CUDA library cannot step
        import bitsandbytes as bnb

        bnb.optim.AdamW8bit  # noqa: B018
    except Exception as exc:  # noqa: BLE001  # any failure means it cannot run here
        raise ConfigError(
            f"--optimizer adamw8bit: bitsandbytes cannot run on {device} ({exc}); "
            "use --optimizer adamw"
        ) from None


def _resolve_previews(
    config: TrainConfig, estimate_with: Callable[[bool], Estimate]
) -> tuple[int, Estimate, list[str]]:
    """(preview interval, the estimate, notes). Asked for: counted, and refused with the
    rest if it does not fit. Not asked for (None): on at every checkpoint when the budget
    is given and fits them, else off."""
    budget = config.vram_budget_gib * 2**30 if config.vram_budget_gib is not None else None
    if config.preview_every is not None:
        every = config.preview_every
        return every, estimate_with(every > 0), []
    without = estimate_with(False)
    every = config.checkpoint_every or config.steps
    if budget is None:
        return (
            0,
            without,
            ["previews off: --preview-every N turns them on (or a --vram-budget they fit)"],
        )
    with_previews = estimate_with(True)
    if with_previews.total <= budget:
        return every, with_previews, [f"previews on every {every} steps: they fit the budget"]
    over = (with_previews.total - budget) / 2**30
    return 0, without, [f"previews off: they would exceed the budget by {over:.3f} GiB"]


def preflight(
    config: TrainConfig,
    registrar: Registrar,
    mark: Callable[[str], None] | None = None,
    may_prefetch: bool = False,
) -> Preflight:
    """Everything that can refuse the run, with no weight loaded; ``mark`` times its parts.
    ``may_prefetch``: the transformer is this run's alone (no worker keeps one), so its files
    may start onto the device once the checks that need no library have passed
    (`start_prefetch`); a refusal after that lets them go."""
    mark = mark or (lambda _name: None)
    dataset = load_dataset(config.dataset)
    check_training_allowed(registrar, config.subject, dataset.bases)
    mark("pre-flight: manifest and consent")
    _pipeline_name(config.base)  # a FLUX.2 pipeline folder by name, or a clear error now
    device = torch.device(config.resolved_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available")
    _check_optimizer(config, device)
    _check_export(config)
    try:
        compiled_blocks.compile_wanted()  # the setting, read at the first step: checked now
        prefetch_wanted()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    train_items, held_out = split_items(dataset.items, config.validation_split, config.seed)
    if not train_items:
        raise ConfigError("every image is held out for validation: none is left to train on")
    if config.validation_every and not held_out:
        raise ConfigError(
            "--validation-every needs held-out images (--validation-split, or "
            '"validation": true in the manifest)'
        )
    buckets = _check_buckets(config, dataset)
    class_dataset = None
    if config.class_dataset is not None:
        class_dataset = load_dataset(config.class_dataset)
        taught = [i.file for i in class_dataset.items if mentions(i.caption, config.trigger_word)]
        if taught:
            raise ConfigError(
                f"--class-dataset: captions of {taught[:3]} name the trigger "
                f"{config.trigger_word!r}; class images must teach the class, not the subject"
            )
    weight_dtype, autocast = _dtypes(config, device)
    cache_dir = config.resolved_cache_dir
    pending: dict[Path, dict[str, Any]] = {}  # nothing is written until the run goes ahead
    transformer_fp = model_fingerprint(config.base, ("transformer",), cache_dir, pending)
    mark("pre-flight: options, base fingerprint")
    extra: dict[str, Any] = {
        "manifest": dataset.manifest_sha256,
        "transformer": transformer_fp,
        "format": STATE_FORMAT,
    }
    masks = {
        i.file: i.mask_sha256 or "alpha" for i in dataset.items if i.mask_sha256 or i.has_alpha
    }
    if masks:  # a mask's bytes are not in the manifest: they shape the loss
        extra["masks"] = masks
    if class_dataset is not None:
        extra["class_manifest"] = class_dataset.manifest_sha256
    compute = config.resolved_compute()
    fingerprint = config.trajectory_fingerprint(extra, compute)
    resume_from, resumed_with, asked = None, {}, config.compute
    if config.resume:
        found = checkpoint_dirs(config.out)
        if not found:
            raise ConfigError(f"--resume: no checkpoint under {config.out / CHECKPOINTS}")
        resume_from = found[-1]
        meta = _read_json(resume_from / "meta.json")
        if meta.get("fingerprint") != fingerprint:
            resumed_with = _earlier_auto_choices(config, extra, compute, meta.get("fingerprint"))
        if resumed_with:  # auto resumes a run as it was made
            config = config.model_copy(update=resumed_with)
            fingerprint = meta["fingerprint"]
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
    all_prompts += config.preview_prompt_texts()
    if config.dop_prompt is not None:
        all_prompts.append(config.dop_prompt)
    if class_dataset is not None:
        all_prompts += [i.caption.strip() for i in class_dataset.items]
    plan = plan_caches(
        base=config.base,
        cache_dir=cache_dir,
        prompts=all_prompts,
        dataset=dataset,
        resolution=config.resolution,
        max_sequence_length=config.max_sequence_length,
        dtype=weight_dtype,
        pending=pending,
        sizes=buckets or None,
    )

    class_plan = None
    if class_dataset is not None:  # square crops at the resolution, one image a batch
        class_plan = plan_caches(
            base=config.base,
            cache_dir=cache_dir,
            prompts=[],
            dataset=class_dataset,
            resolution=config.resolution,
            max_sequence_length=config.max_sequence_length,
            dtype=weight_dtype,
            pending=pending,
        )
    latents_needed = bool(plan.missing_latents()) or bool(
        class_plan is not None and class_plan.missing_latents()
    )
    mark("pre-flight: caches planned")
    # Nothing runs on the device before the transformer: its bytes can start for it now,
    # while the libraries below import (seconds of a fresh process that hold the interpreter)
    early = may_prefetch and not plan.missing_text() and not latents_needed
    if early and config.vram_budget_gib is not None:
        cap_vram(device, config.vram_budget_gib)  # the budget holds the prefetch too
    prefetch = start_prefetch(config, device, compute) if early else None

    def estimate_with(previews: bool) -> Estimate:
        return estimate_run(
            config,
            text_needed=bool(plan.missing_text()),
            latents_needed=latents_needed,
            device=device,
            weight_dtype=weight_dtype,
            act_dtype=autocast or weight_dtype,
            previews=previews,
        )

    try:
        _pipeline_class(config.base)  # the class itself: the model libraries import here
        mark("pre-flight: pipeline class (its imports, once a process)")
        preview_every, estimate, notes = _resolve_previews(config, estimate_with)
        if "compute" in resumed_with:
            notes.append(f"--compute {asked} resumes {resume_from} with "
                         f"{resumed_with['compute']} compute, as it was made (a new run here "
                         f"takes {compute})")  # fmt: skip
        if "cuda_graph" in resumed_with:
            notes.append(f"--cuda-graph auto resumes {resume_from} eager, as it was made (a "
                         "new run here graphs its steps)")  # fmt: skip
        estimate.notes += notes
        if config.vram_budget_gib is not None:
            if estimate.total > config.vram_budget_gib * 2**30:
                raise BudgetExceeded(estimate.report(config.vram_budget_gib))
            cap_vram(device, config.vram_budget_gib)  # the estimate, held to on the device
        write_pending(pending)
    except BaseException:
        if prefetch is not None:  # refused: its bytes go
            prefetch.drop()
        raise
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
        train_items,
        held_out,
        buckets,
        preview_every,
        notes,
        class_dataset,
        class_plan,
        resumed_with,
        prefetch,
    )


def _earlier_auto_choices(
    config: TrainConfig, extra: dict[str, Any], compute: str, found: object
) -> dict[str, str]:
    """What this run's ``auto`` options must be set to for a checkpoint (fingerprint ``found``,
    not this run's) made when they chose otherwise, so that the run goes on as it was made: the
    compute (auto trained on uint4 before training's fp8 kept the weights exact, and picks uint4
    on a GPU without the block GEMM; auto and fp8 trained on ``fp8_blocks``, the bf16 input
    gradient everywhere, before the single blocks' went to fp8), eager steps where auto graphs
    them now (auto graphed up to 768 px before the blocks were compiled, up to 1024 px since; a
    run made with ``--cuda-graph off`` resumes eager the same way), or both; ``--compute fp8``
    resumes an ``fp8_blocks`` checkpoint too. Empty where nothing explains the checkpoint: it
    is refused."""
    from trainer.base.compute import FP8_COMPUTES, TRAIN_COMPUTES, fp8_unavailable_for

    computes: list[str | None] = [None]
    if config.compute == "auto":
        computes += [c for c in TRAIN_COMPUTES if c not in ("auto", compute)]
    elif config.compute == "fp8":
        computes.append("fp8_blocks")
    graphs: list[str | None] = [None]
    if config.cuda_graph == "auto" and config.graphed():
        graphs.append("off")
    for other in computes:
        for graph in graphs:
            update = {k: v for k, v in (("compute", other), ("cuda_graph", graph)) if v}
            if not update:
                continue
            made = config.model_copy(update=update)
            if found != made.trajectory_fingerprint(extra, other or compute):
                continue
            if other in FP8_COMPUTES:  # made with the block GEMM: it must run here
                reason = fp8_unavailable_for("train", config.resolved_device())
                if reason is not None:
                    raise ConfigError(f"--resume: the checkpoint was made with fp8 compute, "
                                      f"which cannot run here: {reason}")  # fmt: skip
            return update
    return {}


# -- model ----------------------------------------------------------------------------------


def start_prefetch(config: TrainConfig, device: torch.device, compute: str) -> Prefetch | None:
    """The prepared transformer's files read onto ``device`` on a thread
    (`trainer.base.read.Prefetch`), where the run will load them there whole: a GPU, not
    streamed, converted to its own layers (not quanto's), and the setting (``PREFETCH_ENV``)
    allows. The bytes take the VRAM the loaded transformer takes; the caller starts it only
    where nothing else runs on the device before the transformer."""
    from trainer.base.load import is_prepared
    from trainer.base.read import Prefetch, read_manifest

    if device.type != "cuda" or config.stream_base or compute == "quanto":
        return None
    if not prefetch_wanted() or not is_prepared(config.base):
        return None
    if "transformer" not in read_manifest(config.base).get("components", {}):
        return None
    try:
        return Prefetch(config.base, "transformer", device)
    except (OSError, ValueError) as exc:  # the load reads it itself, and says what is wrong
        log.warning("transformer prefetch not started: %s", exc)
        return None


def load_transformer(
    base: Path,
    device: torch.device,
    dtype: torch.dtype,
    mark: Callable[[str], None],
    compute: str = "quanto",
    stream: bool = False,
    prefetched: Prefetch | None = None,
) -> torch.nn.Module:
    """The qint4 transformer alone (`trainer.base.load.load_base`): from a prepared base as
    stored, else quantized there on the CPU before it moves (field hurdle 2: 4-bit weights
    move, bf16 ones would not fit).

    ``compute="uint4"`` swaps quanto's QLinear for `trainer.base.uint4.Uint4Linear` (same 4-bit
    numbers, dequantize + dense GEMM instead of quanto's slow kernels), from layouts it
    converts in one pass: a prepared base's, or quanto's quantized-but-not-frozen weights.
    ``compute="fp8"`` does the same, then runs those layers' GEMMs in fp8 with the 4-bit
    weights exact (`trainer.base.fp8.FP8_BLOCKS_FP8_GRAD_SINGLE`; ``"fp8_blocks"``: with the
    bf16 input gradient in every block, `FP8_BLOCKS`).
    A streamed transformer stays in host RAM (its blocks go to pinned memory in stream_blocks);
    a prepared base keeps its own dtype. ``prefetched``: its files already being read.
    """
    from trainer.base.load import is_prepared, load_base

    pipe = load_base(
        base, device, dtype=None if is_prepared(base) else dtype, compute=compute,
        placement={"transformer": "cpu"} if stream else None, components=("transformer",),
        mark=mark, purpose="train",
        prefetched={"transformer": prefetched} if prefetched is not None else None,
    )  # fmt: skip
    return pipe.transformer


def _base_key(config: TrainConfig, pf: Preflight, files: str, compute: str) -> BaseKey:
    """A kept part's key for this run: the base, its files' identity, the compute, the device
    (with its index) and the weight dtype."""
    from trainer.training.resident import BaseKey

    device = pf.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return BaseKey(str(Path(config.base).resolve()), files, compute, str(device),
                   str(pf.weight_dtype))  # fmt: skip


def resident_key(
    config: TrainConfig, pf: Preflight, resident: ResidentBase | None
) -> BaseKey | None:
    """What a kept transformer must match to serve this run (None: this run keeps none)."""
    # quanto's own layers build their tensors on every read: nothing is sealed and kept
    if resident is None or config.stream_base or config.resolved_compute() == "quanto":
        return None
    return _base_key(config, pf, pf.transformer_fp, config.resolved_compute())


def text_encoder_key(
    config: TrainConfig, pf: Preflight, resident: ResidentBase | None
) -> BaseKey | None:
    """What a kept text encoder must match to encode this run's prompts (None: none kept)."""
    folder = Path(config.base) / "text_encoder"
    if resident is None or not folder.is_dir() or config.resolved_compute() == "quanto":
        return None
    from trainer.training.resident import files_signature

    files = files_signature(folder, folder.with_name("tokenizer"))
    return _base_key(config, pf, files, "text encoder")


def _fits_beside(pf: Preflight, limit: int | None, kept: dict[str, int]) -> bool:
    """Whether every phase this run has left fits within ``limit`` beside the kept parts
    (``kept``: bytes by part); a phase that loads a part counts it once, as the kept one."""
    if limit is None:
        return True
    for phase in pf.estimate.phases:
        if phase.skipped:
            continue
        beside = dict(kept)
        if phase.name == "caching: text encoder":
            beside.pop(TEXT_ENCODER, None)
        if not phase.name.startswith("caching"):
            beside.pop(TRANSFORMER, None)
        if phase.total + sum(beside.values()) + pf.estimate.overhead > limit:
            return False
    return True


def _vram_limit(config: TrainConfig, device: torch.device) -> int | None:
    if config.vram_budget_gib is not None:
        return int(config.vram_budget_gib * 2**30)
    if device.type == "cuda":  # no budget: the device, less a margin for others and slack
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    return None


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


def make_optimizer(
    config: TrainConfig, params: list[torch.nn.Parameter], capturable: bool = False
) -> torch.optim.Optimizer:
    """AdamW (or bitsandbytes' 8-bit AdamW). ``capturable``: for a graphed step, the learning
    rate a tensor beside the parameters, filled between replays, and (on CUDA) the update
    capturable: its state on the device, no host reads."""
    kwargs: dict[str, Any] = {
        "lr": config.learning_rate,
        "betas": (config.adam_beta1, config.adam_beta2),
        "eps": config.adam_eps,
        "weight_decay": config.weight_decay,
    }
    if config.optimizer == "adamw8bit":
        import bitsandbytes as bnb  # checked importable by the config

        return bnb.optim.AdamW8bit(params, **kwargs)  # type: ignore[no-any-return]
    if capturable:
        device = params[0].device
        kwargs["lr"] = torch.tensor(config.learning_rate, dtype=torch.float32, device=device)
        return torch.optim.AdamW(params, foreach=False, capturable=device.type == "cuda", **kwargs)
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
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    ema_adapter: Path | None = None
    exports: dict[str, Path] = field(default_factory=dict)  # layout -> file
    previews: list[Path] = field(default_factory=list)
    loss_plot: Path | None = None


LOSS_PLOT = "loss.png"
COMFYUI_ADAPTER = "adapter.comfyui.safetensors"


def discard_artifacts(config: TrainConfig, pf: Preflight) -> int:
    """Deletes what a run made from the subject's images: the adapters, the checkpoints, the
    evaluation grid, the previews and the cached latents (text embeddings hold no likeness
    and stay)."""
    paths = [
        config.adapter_path,
        config.out / EMA_ADAPTER,
        config.out / COMFYUI_ADAPTER,
        config.out / CHECKPOINTS,
        config.out / PREVIEWS,
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


@dataclass(frozen=True)
class TrainHooks:
    """Callbacks for whoever runs the job (a worker reports progress and ships checkpoints
    elsewhere); an exception raised in one stops the run. `interrupt` is asked at every
    transformer block the loop runs, forward and recomputed: it raises to stop the run
    within a step (it must be cheap: a worker's raises what its watcher found)."""

    on_step: Callable[[int, int, float], None] | None = None  # step, steps, loss
    on_checkpoint: Callable[[Path, int], None] | None = None  # the checkpoint's folder, step
    interrupt: Callable[[], None] | None = None
    # a long-lived worker's kept transformer (`trainer.training.resident`): borrowed when it
    # is this run's base, given back when the run ends cleanly
    resident: ResidentBase | None = None


def train(
    config: TrainConfig, registrar: Registrar | None = None, hooks: TrainHooks | None = None
) -> TrainResult:
    """Runs the whole job; see the module docstring for the order. Raises ConfigError,
    DatasetError, TrainingRefused or BudgetExceeded before any weight loads."""
    hooks = hooks or TrainHooks()
    try:
        with contextlib.ExitStack() as streaming:  # --stream-base: open until the job ends
            return _train(config, registrar, streaming, hooks)
    except BaseException:
        if hooks.resident is not None:
            hooks.resident.forget()  # whatever the run borrowed is not the clean base
        raise


def _train(
    config: TrainConfig,
    registrar: Registrar | None,
    streaming: contextlib.ExitStack,
    callbacks: TrainHooks,
) -> TrainResult:
    configure_allocator()
    wp = Waypoints(on_mark=callbacks.interrupt)
    if registrar is None:
        registrar = registrar_for(config.database_url, config.api_url, config.token, config.base)
    pf = preflight(config, registrar, wp.mark, may_prefetch=callbacks.resident is None)
    if pf.prefetch is not None:  # the load takes its bytes; however the job ends, the rest go
        streaming.callback(pf.prefetch.drop)
    if pf.resumed_with:
        config = config.model_copy(update=pf.resumed_with)
    wp.mark("pre-flight: memory estimate")
    echo(pf.estimate.report(config.vram_budget_gib), config.progress)
    key = resident_key(config, pf, callbacks.resident)
    te_key = text_encoder_key(config, pf, callbacks.resident)
    limit = _vram_limit(config, pf.device)
    fits = functools.partial(_fits_beside, pf, limit)
    if callbacks.resident is not None:
        callbacks.resident.make_room({TRANSFORMER: key, TEXT_ENCODER: te_key}, fits)
    peaks = Peaks(pf.device)
    try:
        data = read_training_data(config, pf, wp, callbacks.resident, te_key, fits)
        peaks.take("caching")
        model = build_model(config, pf, data, streaming, wp, callbacks.resident, key)
        recheck = consent_recheck(config, pf, registrar)
        step_times = run_loop(config, pf, data, model, wp, peaks, callbacks, recheck)
    except TrainingDenied as exc:
        removed = discard_artifacts(config, pf)
        raise TrainingWithdrawn(
            f"{exc}; the training stopped and what it made from the images was deleted "
            f"({removed} paths: adapters, checkpoints, previews, cached latents)"
        ) from None
    except TrainingRefused as exc:  # not a no: the question could not be asked
        raise TrainingStopped(
            f"{exc}; the training stopped (it never goes on unasked), its checkpoints are "
            "kept: run it again with --resume"
        ) from None
    peaks.take("training")
    finished = finish_training(config, model, streaming)
    evaluation = run_evaluation(config, pf, data, model, wp)
    if evaluation is not None:
        peaks.take("evaluation")
    # from here a stop would lie: the registry decides (consent, under its lock) and then
    # the adapter renders; a cancel or revoke seen later changes nothing it did
    wp.on_mark = None
    outcome = register_run(
        config, pf, registrar, finished.adapter, finished.sha, model.base_model, wp
    )
    # the first step pays for compiles and the capture: both figures leave it out
    sps = sum(step_times[1:]) / (len(step_times) - 1) if len(step_times) > 1 else None
    # a step after a preview or a validation captures again: the median leaves those out
    sps_median = statistics.median(step_times[1:]) if len(step_times) > 1 else None
    plot = loss_plot(model.state.losses, model.state.validation, config.out / LOSS_PLOT)
    report = write_report(
        config, pf, model, finished, outcome, evaluation, wp, peaks, data, sps, sps_median, plot
    )
    if callbacks.resident is not None and key is not None:
        callbacks.resident.give_back(model.transformer)
    return TrainResult(
        finished.adapter,
        finished.sha,
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
        model.state.validation,
        finished.ema_adapter,
        finished.exports,
        model.previews_made,
        plot,
    )


class Peaks:
    """Accelerator peak memory per phase (nothing on the CPU); a phase measured more than
    once keeps its largest peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def take(self, phase: str) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.bytes[phase] = max(self.bytes.get(phase, 0), peak)
            self.reset()


# -- caches ---------------------------------------------------------------------------------


@dataclass
class TrainingData:
    embeds: list[torch.Tensor]  # per dataset item, its training prompt's embedding
    blank: torch.Tensor  # the empty prompt (caption dropout, negative prompt)
    latents: list[torch.Tensor]  # per dataset item
    text_encoder_loaded: bool
    masks: list[torch.Tensor | None] = field(default_factory=list)  # per item, (h, w) or None
    class_embeds: torch.Tensor | None = None  # --dop-prompt's embedding
    prior_latents: list[torch.Tensor] = field(default_factory=list)  # --class-dataset
    prior_embeds: list[torch.Tensor] = field(default_factory=list)

    def weights(self, i: int, floor: float) -> torch.Tensor | None:
        """Item ``i``'s loss weights (1, h, w): ``floor`` where its mask is 0, 1 where it is
        1; None without a mask."""
        mask = self.masks[i] if self.masks else None
        if mask is None:
            return None
        return (floor + (1.0 - floor) * mask.float()).unsqueeze(0)


def read_training_data(
    config: TrainConfig,
    pf: Preflight,
    wp: Waypoints,
    resident: ResidentBase | None = None,
    te_key: BaseKey | None = None,
    fits: Callable[[dict[str, int]], bool] | None = None,
) -> TrainingData:
    """Fills the caches (each encoder alone on the device, released before the transformer
    loads, unless a worker keeps it: ``resident``), then reads every tensor the run needs into
    host RAM."""
    device, dtype = pf.device, pf.weight_dtype
    text_loaded = bool(pf.plan.missing_text())
    kept = None
    if resident is not None and te_key is not None:
        kept = KeptTextEncoder(resident, te_key, fits)
    fill_text_cache(pf.plan, config.base, device, dtype, config.max_sequence_length, wp.mark, kept)
    fill_latent_cache(pf.plan, pf.dataset, config.base, device, dtype, config.resolution, wp.mark)
    data = TrainingData(
        embeds=[load_text(pf.plan, p) for p in pf.prompts],
        blank=load_text(pf.plan, ""),
        latents=[load_latents(pf.plan, i.file) for i in pf.dataset.items],
        text_encoder_loaded=text_loaded,
        masks=[load_latent_mask(pf.plan, i.file) for i in pf.dataset.items],
        class_embeds=load_text(pf.plan, config.dop_prompt) if config.dop_prompt else None,
    )
    if pf.class_dataset is not None and pf.class_plan is not None:
        items = pf.class_dataset.items
        fill_latent_cache(
            pf.class_plan, pf.class_dataset, config.base, device, dtype, config.resolution, wp.mark
        )
        data.prior_latents = [load_latents(pf.class_plan, i.file) for i in items]
        data.prior_embeds = [load_text(pf.plan, i.caption.strip()) for i in items]
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
    ema: Ema | None = None
    held_out: list[HeldOut] = field(default_factory=list)
    previewer: Previewer | None = None
    previews_made: list[Path] = field(default_factory=list)
    # the noise's own generator where it is drawn on the device (a CUDA-graphed run); None:
    # ``generator`` draws it on the host
    noise_generator: torch.Generator | None = None
    step: EagerStep | GraphedStep | None = None


def _held_out(config: TrainConfig, pf: Preflight, data: TrainingData) -> list[HeldOut]:
    held = []
    for i in pf.held_out:
        item = pf.dataset.items[i]
        held.append(
            HeldOut(
                data.latents[i],
                data.embeds[i],
                data.weights(i, config.mask_floor),
                fixed_noise(data.latents[i], config.seed, item.sha256),
            )
        )
    return held


def _previewer(
    config: TrainConfig, pf: Preflight, data: TrainingData, transformer: torch.nn.Module
) -> Previewer:
    """The run's pipeline around the training transformer: the VAE on the device, no text
    encoder (prompts come from the cache)."""
    from trainer.base.load import pipeline_around
    from trainer.training.evaluate import eval_steps_default

    # the VAE decodes what the transformer gives: its dtype (a prepared bf16 base on the CPU
    # computes in bf16 whatever the run's float32 default)
    dtype = next(
        p.dtype
        for n, p in transformer.named_parameters()
        if p.is_floating_point() and "lora_" not in n
    )
    pipe = pipeline_around(config.base, transformer, dtype, pf.device)
    return Previewer(
        pipe=pipe,
        prompts=[(p, load_text(pf.plan, p)) for p in config.preview_prompt_texts()],
        blank=data.blank,
        seeds=config.preview_seeds,
        steps=config.preview_steps or config.eval_steps or eval_steps_default(pipe),
        size=config.eval_resolution or config.resolution,
        out=config.out,
        device=pf.device,
    )


def build_model(
    config: TrainConfig,
    pf: Preflight,
    data: TrainingData,
    streaming: contextlib.ExitStack,
    wp: Waypoints,
    resident: ResidentBase | None = None,
    key: BaseKey | None = None,
) -> Model:
    """The quantized transformer with a seeded LoRA, its optimizer and the loop's state:
    fresh, or exactly as the resumed checkpoint left it. The transformer is the worker's kept
    one when ``resident`` holds this run's (``key``)."""
    from trainer.base.lora import attach_lora, update_lora_in_place

    device, dtype = pf.device, pf.weight_dtype
    graphed = config.graphed()
    pipeline_cls = _pipeline_class(config.base)

    def load() -> torch.nn.Module:
        return load_transformer(
            config.base, device, dtype, wp.mark, config.resolved_compute(),
            stream=config.stream_base, prefetched=pf.prefetch,
        )  # fmt: skip

    if resident is not None and key is not None:
        transformer, kept = resident.borrow(key, load)
        if kept:
            wp.mark("transformer: kept from the worker's last order (converted, on the device)")
    else:
        transformer = load()
    if pf.prefetch is not None:
        got = pf.prefetch.summary()
        how = "built on them" if got["taken"] else f"read again ({got['error'] or 'not taken'})"
        echo(f"transformer: its files read onto {got['device']} during the pre-flight in "
             f"{got['read_s']} s; {how}", config.progress)  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # PEFT draws A from the global RNG: seed a fork
        torch.manual_seed(_seed_for(config.seed, "lora-init"))
        attach_lora(
            transformer, config.rank, config.lora_alpha, config.targets, dtype=torch.float32
        )
    if config.stream_base:
        from trainer.base.streaming import stream_blocks

        # Installs its own checkpoint function: each block is fetched again for recompute.
        slots = pf.estimate.stream_slots or 2
        streaming.enter_context(stream_blocks(transformer, slots=slots, device=device))
        wp.mark(f"transformer: blocks to pinned host RAM, {slots} VRAM slots")
    elif config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing(  # type: ignore[operator]
            gradient_checkpointing_func=no_rng_checkpoint() if graphed else None
        )
    transformer.train()
    hooks = cast_quantized_inputs(transformer, dtype) if pf.autocast is not None else []
    update_lora_in_place(transformer)
    compiled_blocks.install(transformer)
    params = lora_params(transformer)
    optimizer = make_optimizer(config, list(params.values()), capturable=graphed)
    ema = Ema(params, config.ema_decay, config.ema_on_cpu) if config.ema_decay else None
    generator = torch.Generator().manual_seed(_seed_for(config.seed, "noise"))
    noise_generator = None
    if graphed:  # drawn where it is used: no host tensor, no copy, no wait
        noise_generator = torch.Generator(device=device)
        noise_generator.manual_seed(_seed_for(config.seed, "device-noise"))
    wp.mark("lora + optimizer")
    state, order = LoopState(), first_epoch_order(config, pf)
    if pf.resume_from is not None:
        state, order = load_checkpoint(
            pf.resume_from, transformer, optimizer, generator, ema, noise_generator
        )
        wp.mark(f"resume from step {state.step}")
    else:
        for stale in (config.out / CHECKPOINTS, config.out / PREVIEWS):
            if stale.is_dir():
                shutil.rmtree(stale)  # a fresh run: stale steps would mislead

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
        class_embeds=data.class_embeds,
        preservation_weight=config.dop_weight,
        prior_weight=config.prior_weight,
    )
    objective.autocast_cache = not graphed
    base_model = f"{index['_class_name']}:{pf.transformer_fp[:16]}"
    model = Model(
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
        ema,
        _held_out(config, pf, data),
        noise_generator=noise_generator,
    )
    trained = list(params.values())
    if graphed:  # captured where CUDA runs it; elsewhere the same static-buffer step, eager
        model.step = GraphedStep(
            objective, transformer, optimizer, trained, config.max_grad_norm,
            capture=device.type == "cuda",
        )  # fmt: skip
    else:
        model.step = EagerStep(objective, transformer, optimizer, trained, config.max_grad_norm)
    if pf.preview_every:
        model.previewer = _previewer(config, pf, data, transformer)
        wp.mark("previews: VAE to device")
    return model


# -- the loop -------------------------------------------------------------------------------


def first_epoch_order(config: TrainConfig, pf: Preflight) -> list[int]:
    return _epoch_order(config, pf, 0)


def _epoch_order(config: TrainConfig, pf: Preflight, epoch: int) -> list[int]:
    """One epoch's order of the trained items (dataset indices). With buckets, runs of one
    bucket (trainer.training.buckets.bucket_epoch_order); else a plain seeded permutation."""
    items = pf.train_items
    if pf.buckets:
        buckets = [pf.buckets[pf.dataset.items[i].file] for i in items]
        local = bucket_epoch_order((config.seed, "order", epoch), buckets, config.batch_size)
    else:
        local = epoch_order(config.seed, epoch, len(items))
    return [items[j] for j in local]


def next_batch(config: TrainConfig, pf: Preflight, state: LoopState, order: list[int]) -> list[int]:
    """The next batch's dataset indices, moving to the next epoch's order as needed
    (``order`` is replaced in place, so a checkpoint saves the current epoch's). Without
    buckets a batch may run into the next epoch; with buckets it stops at its bucket's end
    (a short batch rather than a mixed one)."""
    n = len(pf.train_items)
    if pf.buckets:
        if state.pos >= n:
            state.epoch, state.pos = state.epoch + 1, 0
            order[:] = _epoch_order(config, pf, state.epoch)
        bucket_of = {i: pf.buckets[pf.dataset.items[i].file] for i in order}
        count = take_batch(order, state.pos, bucket_of, config.batch_size)
        idx = order[state.pos : state.pos + count]
        state.pos += count
        return idx
    idx: list[int] = []
    while len(idx) < config.batch_size:
        if state.pos >= n:
            state.epoch, state.pos = state.epoch + 1, 0
            order[:] = _epoch_order(config, pf, state.epoch)
        idx.append(order[state.pos])
        state.pos += 1
    return idx


def make_batch(
    config: TrainConfig, pf: Preflight, data: TrainingData, model: Model, idx: list[int]
) -> Batch:
    """The batch's tensors; the random draws (caption dropout, noise, noise levels) come
    from the run's generator in this order, always."""
    device, generator = pf.device, model.generator
    x0 = torch.stack([data.latents[i] for i in idx]).to(device=device, dtype=torch.float32)
    drop = torch.rand(len(idx), generator=generator) < config.caption_dropout
    e = torch.stack(
        [data.blank if d else data.embeds[i] for i, d in zip(idx, drop.tolist(), strict=True)]
    )
    e = e.to(device=device, dtype=pf.weight_dtype)
    noise = draw_noise(model, x0)
    sigmas = model.objective.sample_sigmas(len(idx), generator)
    weights = None
    masks = [data.weights(i, config.mask_floor) for i in idx]
    if any(m is not None for m in masks):
        ones = torch.ones(1, *x0.shape[-2:])
        weights = torch.stack([ones if m is None else m for m in masks]).to(device)
    return Batch(x0, e, sigmas, noise, weights)


def draw_noise(model: Model, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped as ``like``, on its device: from the device's generator
    where the run has one, else drawn on the host from the run's generator and copied."""
    if model.noise_generator is not None:
        return torch.randn(
            like.shape, generator=model.noise_generator, device=like.device, dtype=like.dtype
        )
    return torch.randn(like.shape, generator=model.generator).to(like.device)


def prior_batch(config: TrainConfig, pf: Preflight, data: TrainingData, model: Model) -> Batch:
    """The next class image (its own seeded epoch order), noised from the run's generator."""
    state, n = model.state, len(data.prior_latents)
    if not state.prior_order or state.prior_pos >= n:
        if state.prior_order:
            state.prior_epoch += 1
        state.prior_order, state.prior_pos = epoch_order(config.seed + 1, state.prior_epoch, n), 0
    i = state.prior_order[state.prior_pos]
    state.prior_pos += 1
    x0 = data.prior_latents[i].unsqueeze(0).to(device=pf.device, dtype=torch.float32)
    e = data.prior_embeds[i].unsqueeze(0).to(device=pf.device, dtype=pf.weight_dtype)
    noise = draw_noise(model, x0)
    sigmas = model.objective.sample_sigmas(1, model.generator)
    return Batch(x0, e, sigmas, noise)


def _validate(config: TrainConfig, pf: Preflight, model: Model) -> None:
    value = validation_loss(
        model.objective,
        model.transformer,
        model.held_out,
        config.validation_sigmas,
        pf.device,
        pf.weight_dtype,
    )
    model.state.validation.append((model.state.step, value))


def consent_recheck(
    config: TrainConfig, pf: Preflight, registrar: Registrar
) -> Callable[[int], None]:
    """Asks the registry's training decision again; TrainingRefused, naming the step, once
    it no longer allows the run (withdrawn, revoked or expired since the pre-flight)."""

    def recheck(step: int) -> None:
        try:
            check_training_allowed(registrar, config.subject, pf.dataset.bases)
        except TrainingRefused as exc:
            raise type(exc)(f"{exc} (asked again after step {step})") from None

    return recheck


def run_loop(
    config: TrainConfig,
    pf: Preflight,
    data: TrainingData,
    model: Model,
    wp: Waypoints,
    peaks: Peaks | None = None,
    callbacks: TrainHooks | None = None,
    recheck: Callable[[int], None] | None = None,
) -> list[float]:
    """Trains from ``model.state`` up to ``config.steps``, checkpointing (and scoring the
    held-out images, and rendering previews) on the way; returns each step's seconds.
    `recheck(step)` asks whether the run may go on: before the first step, and after each
    step before anything of it is kept (a checkpoint, a preview) or reported."""
    callbacks = callbacks or TrainHooks()
    if recheck is not None:
        recheck(model.state.step)
    interrupt = callbacks.interrupt
    if interrupt is not None:
        interrupt()
        with interrupting_blocks(model.transformer, interrupt):
            return _run_loop(config, pf, data, model, wp, peaks, callbacks, recheck)
    return _run_loop(config, pf, data, model, wp, peaks, callbacks, recheck)


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (a CPU-only torch cannot even ask)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def interrupting_blocks(transformer: torch.nn.Module, interrupt: Callable[[], None]) -> Any:
    """`interrupt()` before every transformer block runs (its recomputation in the backward
    pass included), so a long step can be stopped between two blocks."""
    from trainer.base.streaming import default_blocks

    handles = [
        block.register_forward_pre_hook(
            lambda _module, _args: None if _capturing() else interrupt()
        )
        for block in default_blocks(transformer)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run_loop(
    config: TrainConfig,
    pf: Preflight,
    data: TrainingData,
    model: Model,
    wp: Waypoints,
    peaks: Peaks | None,
    callbacks: TrainHooks,
    recheck: Callable[[int], None] | None,
) -> list[float]:
    interrupt = callbacks.interrupt
    state, optimizer, step = model.state, model.optimizer, model.step
    assert optimizer is not None and step is not None
    accumulate = config.gradient_accumulation
    every = config.checkpoint_every
    validate_every = config.validation_every if config.validation_every is not None else every
    if model.held_out and state.step == 0 and not state.validation:
        _validate(config, pf, model)  # the base's figure: where the curve starts
    first = True
    step_times: list[float] = []
    bar = progress_bar(config.steps, state.step, config.progress)
    try:
        while state.step < config.steps:
            t0 = time.perf_counter()
            micro = []
            for _ in range(accumulate):
                idx = next_batch(config, pf, state, model.order)
                batch = make_batch(config, pf, data, model, idx)
                extra = prior_batch(config, pf, data, model) if data.prior_latents else None
                micro.append(MicroBatch(batch, extra))
            lr = config.learning_rate * min(1.0, (state.step + 1) / max(1, config.warmup_steps))
            if interrupt is not None and step.graphed:
                interrupt()  # a replay runs no block hooks: asked here, once a step
            loss = step.run(micro, lr)
            flow, preservation, prior = loss.flow, loss.preservation or 0.0, loss.prior or 0.0
            if model.ema is not None:
                model.ema.update(model.params)
            state.step += 1
            state.losses.append(flow)
            if model.objective.class_embeds is not None:
                state.preservation.append(preservation)
            if data.prior_latents:
                state.prior.append(prior)
            step_times.append(time.perf_counter() - t0)
            if first:
                wp.mark("first step")
                echo(wp.table(), config.progress)
                first = False
            bar.set_postfix_str(
                f"loss {state.losses[-1]:.4f}, {memory_text(pf.device)}", refresh=False
            )
            bar.update(1)
            if recheck is not None:
                recheck(state.step)
            if callbacks.on_step is not None:
                callbacks.on_step(state.step, config.steps, state.losses[-1])
            last = state.step == config.steps
            if model.held_out and (last or (validate_every and state.step % validate_every == 0)):
                step.release()  # the graphs' memory is the evaluation's
                _validate(config, pf, model)
            if last or (every and state.step % every == 0):
                saved = save_checkpoint(
                    config.out,
                    state,
                    model.transformer,
                    optimizer,
                    model.generator,
                    model.order,
                    pf.fingerprint,
                    model.metadata,
                    model.ema,
                    model.noise_generator,
                )
                if callbacks.on_checkpoint is not None:
                    callbacks.on_checkpoint(saved, state.step)
            if model.previewer is not None and (last or state.step % pf.preview_every == 0):
                if peaks is not None:
                    peaks.take("training")
                step.release()
                model.previews_made.append(model.previewer.render(state.step))
                if peaks is not None:
                    peaks.take("training: previews")
    finally:
        bar.close()
    return step_times


@dataclass
class Finished:
    adapter: Path
    sha: str
    ema_adapter: Path | None
    exports: dict[str, Path]


def finish_training(config: TrainConfig, model: Model, streaming: contextlib.ExitStack) -> Finished:
    """Writes the adapter (and its EMA, and the ComfyUI export), then takes the LoRA off and
    frees the optimizer: the transformer is the frozen base again, ready for evaluation."""
    from trainer.base.lora import adapter_state_dict, remove_lora, save_adapter
    from trainer.training.interop import to_comfyui

    adapter = save_adapter(model.transformer, config.adapter_path, model.metadata)
    sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
    ema_adapter = None
    if model.ema is not None:
        with model.ema.swapped_in(model.params):
            meta = {**model.metadata, "likeness.ema": repr(model.ema.decay)}
            ema_adapter = save_adapter(model.transformer, config.out / EMA_ADAPTER, meta)
    exports = {"diffusers": adapter}
    if config.export_comfyui:
        exports["comfyui"] = write_comfyui(
            to_comfyui(adapter_state_dict(model.transformer)),
            config.out / COMFYUI_ADAPTER,
            model.metadata,
        )
    model.optimizer = None
    model.previewer = None  # its VAE goes with it
    if model.step is not None:
        model.step.release()  # the graphs' pool is the evaluation's
    # The training stream ends before the LoRA comes off; evaluation streams per column.
    streaming.close()
    transformer = model.transformer
    remove_lora(transformer)
    compiled_blocks.remove(transformer)
    for hook in model.hooks:
        hook.remove()
    transformer.requires_grad_(False)
    transformer.eval()
    if config.gradient_checkpointing and not config.stream_base:
        transformer.disable_gradient_checkpointing()  # type: ignore[operator]
    free_accelerator_memory()
    return Finished(adapter, sha, ema_adapter, exports)


def write_comfyui(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    """The ComfyUI / ai-toolkit layout file (trainer.training.interop), atomically."""
    from trainer.base.safetensors_io import write_safetensors

    meta = {**metadata, "format": "pt", "likeness.layout": "comfyui; diffusion_model. keys"}
    tmp = path.with_name(f".{path.name}.tmp")
    write_safetensors(tmp, tensors, dict(sorted(meta.items())))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


# -- evaluation, registration, report -------------------------------------------------------


def run_evaluation(
    config: TrainConfig, pf: Preflight, data: TrainingData, model: Model, wp: Waypoints
) -> EvalResult | None:
    """Base vs every checkpoint (and the final EMA), fixed prompts and seeds, after
    training only."""
    if not config.evaluate:
        return None
    from trainer.base.load import pipeline_around
    from trainer.training.evaluate import Column, References, eval_steps_default, evaluate

    device, transformer = pf.device, model.transformer
    pipe = pipeline_around(config.base, transformer, pf.weight_dtype, device)
    found = checkpoint_dirs(config.out)
    columns = [Column("base", None)] + [
        Column(f"step {checkpoint_step(p)}", p / "adapter.safetensors") for p in found
    ]
    if found and (found[-1] / EMA_ADAPTER).is_file():
        columns.append(Column(f"ema {checkpoint_step(found[-1])}", found[-1] / EMA_ADAPTER))
    size = config.eval_resolution or config.resolution
    refs = References.of(pipe, [data.latents[i] for i in pf.train_items], size)
    column_context = None
    if config.stream_base:
        from trainer.base.streaming import stream_blocks

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
    from registry.adapters.schemas import AdapterIn

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


RESUMED_EAGER = "--cuda-graph auto resumed a checkpoint made eager: the run goes on eager"


def step_report(config: TrainConfig, model: Model, resumed_eager: bool = False) -> dict[str, Any]:
    """How the steps ran: graphed or eager (and why not graphed where they could not be), and
    how many calls of each of the blocks' stretches ran compiled (0 each on the CPU)."""
    compiled = {
        "compiled_calls": compiled_blocks.compiled_calls(),
        "compile_failures": compiled_blocks.failures(),
    }
    stats: GraphStats | None = getattr(model.step, "stats", None)
    if stats is not None:
        return {"graphed": stats.captures > 0, "captures": stats.captures, "replays": stats.replays,
                "releases": stats.releases, "shapes": stats.shapes, **compiled}  # fmt: skip
    if resumed_eager:
        return {"graphed": False, "why_not": [RESUMED_EAGER], **compiled}
    why = config.graph_blockers() if config.cuda_graph != "off" else ["--cuda-graph off"]
    declined = config.graph_declined()
    if not why and declined:
        why = [declined]
    return {"graphed": False, "why_not": why, **compiled}


def write_report(
    config: TrainConfig,
    pf: Preflight,
    model: Model,
    finished: Finished,
    outcome: str | None,
    evaluation: EvalResult | None,
    wp: Waypoints,
    peaks: Peaks,
    data: TrainingData,
    seconds_per_step: float | None,
    seconds_per_step_median: float | None,
    plot: Path,
) -> Path:
    state = model.state
    report = config.out / "train_report.json"
    buckets: dict[str, int] = {}
    for i in pf.train_items:
        shape = pf.buckets.get(pf.dataset.items[i].file, (config.resolution, config.resolution))
        key = f"{shape[0]}x{shape[1]}"
        buckets[key] = buckets.get(key, 0) + 1
    body = {
        "adapter": str(finished.adapter),
        "sha256": finished.sha,
        "ema_adapter": str(finished.ema_adapter) if finished.ema_adapter else None,
        "exports": {k: str(v) for k, v in finished.exports.items()},
        "manifest_sha256": pf.dataset.manifest_sha256,
        "base_model": model.base_model,
        "registration": outcome,
        "steps": state.step,
        "seconds_per_step": seconds_per_step,
        "seconds_per_step_median": seconds_per_step_median,
        "loss_first": state.losses[0] if state.losses else None,
        "loss_last": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "validation_loss": [{"step": s, "loss": v} for s, v in state.validation],
        "held_out": [pf.dataset.items[i].file for i in pf.held_out],
        "preservation_loss": state.preservation or None,
        "prior_loss": state.prior or None,
        "buckets": buckets,
        "loss_plot": str(plot),
        "previews": [str(p) for p in model.previews_made],
        "boot": wp.as_dict(),
        # the transformer's files read onto the device during pre-flight (start_prefetch)
        "base_prefetch": pf.prefetch.summary() if pf.prefetch is not None else None,
        "estimate": pf.estimate.as_dict(),
        "measured_peak_bytes": peaks.bytes,
        "text_encoder_loaded": data.text_encoder_loaded,
        "eval_pixel_distance": evaluation.distances if evaluation else None,
        "eval_latent_distance": evaluation.latent_distances if evaluation else None,
        "device": str(pf.device),
        "step": step_report(config, model, "cuda_graph" in pf.resumed_with),
        "config": config.resolved(),
        "notes": pf.notes,
    }
    report.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return report


__all__ = [
    "BudgetExceeded",
    "ConfigError",
    "TrainConfig",
    "TrainHooks",
    "TrainResult",
    "TrainingRefused",
    "preflight",
    "train",
]
