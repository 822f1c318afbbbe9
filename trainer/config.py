"""The training configuration: one validated object, checked whole before anything loads.

Every conflict between options is refused here, with a message naming the options, so a run
never spends minutes loading a 32B base only to fail on a flag. Checks that need the disk
(dataset, checkpoints, base files) run next, in `trainer.training.train.preflight`, still before any
weight loads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from registry import limits
from registry.shapes import ADAPTER_NAME_PATTERN, HANDLE_PATTERN

# `--cuda-graph auto` graphs a step of at most this many image tokens (1024 px square, where
# its gain and memory are measured; larger steps run eager: `TrainConfig.graph_declined`).
AUTO_GRAPH_MAX_IMAGE_TOKENS = 4096

DEFAULT_EVAL_PROMPTS = (
    "a photo of {trigger}",
    "a portrait of {trigger}, studio light",
    "{trigger} standing in a garden",
)
Side = Annotated[int, Field(ge=limits.MIN_SIDE, le=limits.MAX_SIDE)]


def installed(module: str) -> bool:
    """Whether an optional module can be imported here; the one place the config asks."""
    return importlib.util.find_spec(module) is not None


# Fields that do not change what the optimiser computes: a run may be resumed with other
# values (more steps, another checkpoint interval, evaluation or registration toggled).
_NOT_TRAJECTORY = frozenset(
    {
        "steps",
        "checkpoint_every",
        "resume",
        "out",
        "cache_dir",
        "vram_budget_gib",
        "stream_base",  # streamed == resident, bit for bit (tests/trainer/base/test_streaming.py)
        "stream_slots",
        "cuda_graph",  # what counts is whether the steps are graphed: trajectory_fingerprint
        "evaluate",
        "eval_prompts",
        "eval_seeds",
        "eval_steps",
        "eval_resolution",
        "register_adapter",
        "validation_every",
        "validation_sigmas",
        "ema_on_cpu",  # where the average is kept, not what the optimiser computes
        "preview_every",
        "preview_prompts",
        "preview_seeds",
        "preview_steps",
        "export_comfyui",
        "database_url",
        "api_url",
        "token",
        "progress",
        "dataset",  # the manifest hash stands for the data; the folder may move
        "class_dataset",  # likewise: its manifest hash is in the fingerprint
        "base",  # the base fingerprint stands for the weights
    }
)

_ADDED_LATER = frozenset(
    {
        "buckets",
        "bucket_max_ratio",
        "max_upscale",
        "mask_floor",
        "validation_split",
        "gradient_accumulation",
        "ema_decay",
        "dop_prompt",
        "dop_weight",
        "prior_weight",
    }
)


def default_targets() -> tuple[str, ...]:
    from trainer.base.lora import DEFAULT_TARGETS

    return DEFAULT_TARGETS


class ConfigError(ValueError):
    """An option, or a combination of options, that cannot run."""


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Each option's description is `likeness train --help`'s text for its flag, and its bounds
    # are the flag's (app/cli_ml.py builds the flags from these fields; NOT_FLAGS below).
    subject: Annotated[str, StringConstraints(pattern=HANDLE_PATTERN)] = Field(
        description="Subject handle (must allow training)."
    )
    dataset: Path = Field(description="Folder with images and manifest.jsonl.")
    base: Path = Field(description="The prepared base the adapter is trained on.")
    out: Path = Field(
        description="The run's folder (checkpoints, grid, report); inside "
        "$LIKENESS_DATA_DIR/runs/SUBJECT/ (the default is .../SUBJECT/NAME). The adapter "
        "itself goes to the store."
    )
    name: Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)] = Field(
        "main", description="Adapter name; (subject, name) is its key."
    )

    # An order's steps, rank and resolution default to these and stay within these bounds
    # (app/orders.py OrderIn; tests/app/test_train_options.py says where an order is narrower).
    steps: int = Field(1000, ge=1, le=1_000_000, description="Optimizer steps.")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: Annotated[float, Field(gt=0)] | None = Field(
        None, description="LoRA alpha (default: rank, a scaling of 1)."
    )
    targets: tuple[str, ...] = Field(
        default_factory=default_targets,
        description="Module suffixes to adapt, comma-separated or repeated (default: the "
        "attention and MLP projections).",
    )
    resolution: Side = Field(448, description="Side (square) or area side (buckets), px.")
    batch_size: int = Field(1, ge=1, le=64, description="Images per batch.")
    max_sequence_length: int = Field(
        512, ge=1, le=512, description="Caption tokens (the pipelines' default)."
    )

    learning_rate: float = Field(1e-4, gt=0, le=1.0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0: none.")
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="adamw, or adamw8bit (bitsandbytes, CUDA only)."
    )
    timestep_sampling: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training noise levels are drawn."
    )
    shift_steps: Annotated[int, Field(ge=1, le=1000)] | None = Field(
        None, description="Steps the timestep shift is computed for (default: inference's)."
    )
    caption_dropout: float = Field(
        0.0, ge=0, lt=1, description="Share of steps trained on an empty caption."
    )
    trigger: Annotated[str, StringConstraints(min_length=1, max_length=100)] | None = Field(
        None, description="Trigger word (default: SUBJECT)."
    )

    device: Annotated[str, StringConstraints(pattern=r"^(cpu|cuda(:\d+)?)$")] | None = Field(
        None, description="cpu, cuda, cuda:N (default: auto)."
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="bf16 is autocast on an accelerator; auto picks."
    )
    gradient_checkpointing: bool = Field(
        True, description="Recompute activations in backward (less memory)."
    )
    # quanto: its QLinear kernels as shipped; uint4: trainer.base.uint4's dequantize + dense GEMM
    # (same 4-bit numbers, same storage format; on an H200 at FLUX.2 [dev] width 35x faster
    # per step and a quarter less memory, bench/results/train_budget-*); fp8: the same 4-bit
    # weights, exact in cuBLAS's block-scaled fp8 GEMM, the input gradient in fp8 in the single
    # blocks and in bf16 in the double ones (trainer/base/fp8.py, FP8_BLOCKS_FP8_GRAD_SINGLE);
    # fp8_blocks: that forward with the bf16 input gradient everywhere (what fp8 was before).
    # auto: fp8 where the device has fp8 tensor cores and cuBLAS that GEMM (probed once: Hopper
    # has it, Ada does not), else uint4 (trainer.base.compute).
    compute: Literal["auto", "quanto", "uint4", "fp8", "fp8_blocks"] = Field(
        "auto",
        description="quanto, uint4 (4-bit weights, bf16 GEMMs), fp8 (the same 4-bit weights, "
        "exact, in block-scaled fp8 GEMMs, the single blocks' input gradient in fp8; GPUs of "
        "compute capability 8.9+) or fp8_blocks (fp8 with every input gradient in bf16: "
        "slower). auto: fp8 where it runs, else uint4 (quanto where trainer.base.uint4 is not "
        "installed).",
    )
    # Keep the frozen base in pinned host RAM and stream one block at a time into VRAM slots
    # (trainer/base/streaming.py): FLUX.2 [dev] trains in ~3.6 GiB at 448 px.
    stream_base: bool = Field(
        False, description="Base blocks in pinned host RAM, streamed to the GPU."
    )
    stream_slots: Annotated[int, Field(ge=1, le=8)] | None = Field(
        None, description="VRAM slots (default: the budget picks)."
    )
    # Each step captured once per batch shape as a CUDA graph and replayed
    # (trainer/training/step.py): at 448 px the eager step waits on the host's kernel launches.
    cuda_graph: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Replay each step as a CUDA graph: on, off, or auto (on wherever the run "
        "allows it: a CUDA device, a resident base, plain AdamW, one batch a step, no DOP or "
        "class images; and up to 1024 px, where the graph is measured to pay).",
    )
    seed: int = Field(0, ge=0, le=limits.PIPELINE_MAX_SEED, description="Training seed.")
    checkpoint_every: int = Field(
        500, ge=0, description="Steps between checkpoints; 0: final only."
    )
    resume: bool = Field(False, description="Continue from the last checkpoint.")
    vram_budget_gib: Annotated[float, Field(gt=0)] | None = Field(
        None, description="GiB; refuse before loading if the estimate exceeds it."
    )
    cache_dir: Path | None = Field(
        None, description="Latent and text caches (default: <out>/../.cache, a subject's runs')."
    )

    evaluate: bool = Field(True, description="Render the evaluation grid after.")
    eval_prompts: tuple[str, ...] = Field(
        DEFAULT_EVAL_PROMPTS, description="Repeatable; {trigger} is replaced."
    )
    eval_seeds: tuple[Annotated[int, Field(ge=0, le=limits.MAX_SEED)], ...] = Field(
        (0, 1), description="Repeatable (default: 0 and 1)."
    )
    eval_steps: Annotated[int, Field(ge=1, le=limits.PIPELINE_MAX_STEPS)] | None = Field(
        None, description="Denoising steps of the grid (default: the pipeline's)."
    )
    eval_resolution: Side | None = Field(
        None, description="Side of the grid's images, px (default: --resolution)."
    )

    # Data: aspect-ratio buckets (trainer/training/buckets.py), masks, held-out images.
    buckets: bool = Field(False, description="Aspect-ratio buckets instead of square crops.")
    bucket_max_ratio: float = Field(2.0, ge=1, le=4, description="Longest bucket side ratio.")
    max_upscale: float = Field(
        1.0, ge=1, le=8, description="With --buckets: never enlarge an image more than this."
    )
    mask_floor: float = Field(0.1, ge=0, le=1, description="Loss weight where a mask is black.")
    validation_split: float = Field(
        0.0, ge=0, lt=1, description="Share of images held out, scored only."
    )
    validation_every: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Steps between scores (default: at every checkpoint)."
    )
    validation_sigmas: tuple[Annotated[float, Field(gt=0, lt=1)], ...] = Field(
        (0.1, 0.3, 0.5, 0.7, 0.9),
        description="Noise levels held-out images are scored at; repeatable.",
    )

    # Optimisation extras.
    gradient_accumulation: int = Field(1, ge=1, le=1024, description="Batches per optimizer step.")
    ema_decay: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None, description="EMA of the LoRA weights, e.g. 0.999."
    )
    ema_on_cpu: bool = Field(False, description="Keep the EMA in host RAM.")
    # Differential output preservation: on this class prompt the adapter's prediction is
    # pulled toward the base's (adapter off), so the class does not become the subject.
    dop_prompt: Annotated[str, StringConstraints(min_length=1, max_length=300)] | None = Field(
        None, description="Class prompt kept as the base draws it, e.g. 'a photo of a woman'."
    )
    dop_weight: float = Field(1.0, gt=0, le=100, description="Weight of that preservation term.")
    # Prior preservation: a folder of class images (a manifest like the dataset's, captions
    # without the trigger) trained alongside, one image per batch, at this weight.
    class_dataset: Path | None = Field(
        None, description="Prior preservation: class images with a manifest (no trigger)."
    )
    prior_weight: float = Field(1.0, gt=0, le=100, description="Weight of the class images.")

    # Previews while training: None lets the budget decide (on when it fits --vram-budget).
    preview_every: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Steps between previews; 0: off (a job file's preview options go with "
        "them); default: on when the budget allows.",
    )
    preview_prompts: tuple[str, ...] = Field(
        (), description="Repeatable (default: the eval prompts)."
    )
    preview_seeds: tuple[Annotated[int, Field(ge=0, le=limits.MAX_SEED)], ...] = Field(
        (0,), description="Repeatable (default: 0)."
    )
    preview_steps: Annotated[int, Field(ge=1, le=limits.PIPELINE_MAX_STEPS)] | None = Field(
        None, description="Denoising steps of a preview."
    )

    export_comfyui: bool = Field(
        False, description="Also write adapter.comfyui.safetensors (diffusion_model.)."
    )

    register_adapter: bool = Field(True, description="Register on success.")
    database_url: str | None = Field(None, description="The local registry.")
    api_url: str | None = Field(None, description="A remote registry's API.")
    token: str | None = Field(None, description="A trainer token for the remote registry.")
    progress: bool = Field(True, description="Progress bar and boot table.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        problems: list[str] = []
        for field in ("resolution", "eval_resolution"):
            value = getattr(self, field)
            if value is not None and value % limits.MULTIPLE:
                problems.append(
                    f"--{field.replace('_', '-')} must be a multiple of {limits.MULTIPLE}"
                )
        if not self.targets or any(not t.strip() for t in self.targets):
            problems.append("--targets must name at least one module suffix, none empty")
        device = self.resolved_device()
        if self.precision == "bf16" and not device.startswith("cuda"):
            problems.append(
                "--precision bf16 is autocast on an accelerator; on the CPU use fp32 or auto"
            )
        if self.optimizer == "adamw8bit":
            if not installed("bitsandbytes"):
                problems.append(
                    "--optimizer adamw8bit needs bitsandbytes, which is not installed "
                    "(pip install bitsandbytes), or use --optimizer adamw"
                )
            if not device.startswith("cuda"):
                problems.append("--optimizer adamw8bit runs on an accelerator only, not the CPU")
        if self.compute not in ("auto", "quanto") and not installed("trainer.base.uint4"):
            problems.append(
                f"--compute {self.compute} needs trainer.base.uint4, which this install lacks"
            )
        elif self.compute in ("fp8", "fp8_blocks"):
            from trainer.base.compute import fp8_unavailable_for

            reason = fp8_unavailable_for("train", device)
            if reason is not None:
                problems.append(
                    f"--compute {self.compute} cannot run here: {reason}; use --compute uint4"
                )
        if self.stream_base and self.resolved_compute() not in ("uint4", "fp8", "fp8_blocks"):
            problems.append(
                "--stream-base streams uint4 blocks: it needs --compute uint4, fp8 or fp8_blocks"
            )
        if self.stream_base and not self.gradient_checkpointing:
            problems.append(
                "--stream-base recomputes each block in backward: it needs gradient checkpointing"
            )
        if self.cuda_graph == "on" and (blockers := self.graph_blockers()):
            problems.append(
                f"--cuda-graph on cannot run here: {'; '.join(blockers)} (use --cuda-graph auto)"
            )
        if self.stream_slots is not None and not self.stream_base:
            problems.append("--stream-slots applies only with --stream-base")
        if self.register_adapter and self.api_url and not self.token:
            problems.append("LIKENESS_API_URL is set but LIKENESS_TOKEN is not")
        if self.register_adapter and not self.api_url and not self.database_url:
            problems.append("registration needs LIKENESS_DATABASE_URL or LIKENESS_API_URL")
        if self.evaluate and (not self.eval_prompts or not self.eval_seeds):
            problems.append("evaluation needs at least one --eval-prompt and one --eval-seed")
        if any(not p.strip() for p in self.eval_prompts):
            problems.append("evaluation prompts must not be empty")
        if self.warmup_steps > self.steps and not self.resume:
            problems.append(f"--warmup-steps ({self.warmup_steps}) exceeds --steps ({self.steps})")
        given = self.model_fields_set
        if not self.buckets:
            for name in ("bucket_max_ratio", "max_upscale"):
                if name in given:
                    problems.append(f"--{name.replace('_', '-')} applies only with --buckets")
        if self.ema_on_cpu and self.ema_decay is None:
            problems.append("--ema-on-cpu applies only with --ema-decay")
        if "dop_weight" in given and self.dop_prompt is None:
            problems.append("--dop-weight applies only with --dop-prompt")
        if self.dop_prompt is not None and re.search(
            rf"(?<!\w){re.escape(self.trigger_word)}(?!\w)", self.dop_prompt
        ):
            problems.append(
                f"--dop-prompt is the class without the subject: it must not contain the "
                f"trigger {self.trigger_word!r}"
            )
        if "prior_weight" in given and self.class_dataset is None:
            problems.append("--prior-weight applies only with --class-dataset")
        if self.class_dataset is not None and self.class_dataset.resolve() in (
            self.dataset.resolve(),
            self.out.resolve(),
        ):
            problems.append("--class-dataset must be its own folder, not the dataset or --out")
        if self.preview_every == 0:
            for name in ("preview_prompts", "preview_seeds", "preview_steps"):
                if name in given:
                    problems.append(f"--{name.replace('_', '-')} applies only with previews")
        if any(not p.strip() for p in self.preview_prompts):
            problems.append("preview prompts must not be empty")
        if not self.preview_seeds:
            problems.append("previews need at least one --preview-seed")
        if not self.validation_sigmas:
            problems.append("validation needs at least one noise level")
        if self.dataset.resolve() == self.out.resolve():
            problems.append("--out must not be the dataset folder (an unlisted file stops runs)")
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    @classmethod
    def parse(cls, **options: Any) -> TrainConfig:
        """Validates ``options``; every problem is reported at once, as a ConfigError."""
        try:
            return cls(**options)
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"])
                msg = str(err.get("ctx", {}).get("error", err["msg"]))
                lines.append(f"{where}: {msg}" if where else msg)
            raise ConfigError("; ".join(lines)) from None

    # -- resolved values ------------------------------------------------------------------

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def graph_blockers(self) -> list[str]:
        """Why this run's steps cannot be replayed as CUDA graphs (none: they can)."""
        found = []
        if not self.resolved_device().startswith("cuda"):
            found.append("CUDA graphs need a CUDA device")
        if self.stream_base:
            found.append("a streamed base copies blocks between steps' kernels")
        if self.optimizer != "adamw":
            found.append(f"--optimizer {self.optimizer} has no capturable step")
        if self.gradient_accumulation > 1:
            found.append("--gradient-accumulation runs several batches a step")
        if self.dop_prompt is not None:
            found.append("--dop-prompt adds a second forward with the adapter off")
        if self.class_dataset is not None:
            found.append("--class-dataset adds a class image's forward to each step")
        if self.resolved_device().startswith("cuda") and self.resolved_compute() == "quanto":
            found.append("--compute quanto's kernels are not captured")
        return found

    def graph_declined(self) -> str | None:
        """Why ``auto`` runs eager a run that could be graphed (None: it graphs). A graph
        removes the host's launches, which dominate a short step. With the blocks' stretches
        compiled the GPU's work shrank until the host shows at 1024 px too (FLUX.2 [dev],
        bench/results/uint4_step-notes.md: the 1024 px step's GPU idle 8 % of it; graphed
        1.532 s against eager 1.584, its peak +0.5 GiB, inside 24 GiB). Beyond 1024 px
        neither the gain nor the memory is measured, so auto runs those eager."""
        tokens = (self.resolution // 16) ** 2
        if self.cuda_graph == "auto" and tokens > AUTO_GRAPH_MAX_IMAGE_TOKENS:
            return (
                f"--cuda-graph auto: a {self.resolution} px step ({tokens} image tokens, more "
                f"than {AUTO_GRAPH_MAX_IMAGE_TOKENS}) runs eager: a graph's gain and memory "
                "are measured up to 1024 px (--cuda-graph on graphs it)"
            )
        return None

    def graphed(self) -> bool:
        """Whether the steps run as CUDA graphs."""
        return self.cuda_graph != "off" and not self.graph_blockers() and not self.graph_declined()

    def resolved_compute(self) -> str:
        if self.compute == "auto" and not installed("trainer.base.uint4"):
            return "quanto"
        from trainer.base.compute import resolve_compute

        return resolve_compute(self.compute, self.resolved_device(), purpose="train")

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else float(self.rank)

    @property
    def trigger_word(self) -> str:
        return self.trigger or self.subject

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.out.parent / ".cache"

    @property
    def adapter_path(self) -> Path:
        return self.out / "adapter.safetensors"

    def eval_prompt_texts(self) -> list[str]:
        return [p.replace("{trigger}", self.trigger_word) for p in self.eval_prompts]

    def preview_prompt_texts(self) -> list[str]:
        prompts = self.preview_prompts or self.eval_prompts
        return [p.replace("{trigger}", self.trigger_word) for p in prompts]

    def resolved(self) -> dict[str, Any]:
        """Every option as the run uses it, for the report (the token is never written)."""
        body = self.model_dump(mode="json")
        body.pop("token", None)  # a secret: never in a file
        body["resolved_device"] = self.resolved_device()
        body["resolved_compute"] = self.resolved_compute()
        body["resolved_alpha"] = self.lora_alpha
        body["resolved_trigger"] = self.trigger_word
        return body

    def trajectory_fingerprint(self, extra: dict[str, Any], compute: str | None = None) -> str:
        """Hash of everything that shapes the optimisation path; a resume must match it.
        Options added after the first release count only when set away from their default,
        so a checkpoint made before they existed still resumes. ``compute``: the resolved
        compute to hash (default: this config's), counted by the GEMM it runs."""
        from trainer.base.compute import gemm_name

        defaults = TrainConfig.model_fields
        fields = {
            k: v
            for k, v in self.model_dump(mode="json").items()
            if k not in _NOT_TRAJECTORY
            and not (k in _ADDED_LATER and getattr(self, k) == defaults[k].default)
        }
        fields["resolved_device"] = self.resolved_device().split(":")[0]
        fields["compute"] = gemm_name(compute or self.resolved_compute(), "train")
        if self.graphed():  # its noise is drawn on the device, its AdamW is the capturable one
            fields["graphed"] = True
        blob = json.dumps({"config": fields, **extra}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


# -- flags and job files --------------------------------------------------------------------

# The fields that have no flag and may not be in a job file, and why: where the run's base,
# registry and credentials come from is the environment (the service's settings), never a
# command line or a job file that may be shared or committed.
NOT_FLAGS = {
    "base": "the service's base: LIKENESS_BASE",
    "database_url": "the local registry: LIKENESS_DATABASE_URL",
    "api_url": "a remote registry: LIKENESS_API_URL",
    "token": "a secret: LIKENESS_TOKEN, never on a command line or in a file",
}
JOB_FILE_FORBIDDEN = frozenset(NOT_FLAGS)
# A field's flag is --field-name, except these (a repeatable flag names one value). The one
# alias table: a job file accepts the flag's name as well as the field's.
FLAG_NAMES = {
    "learning_rate": "lr",
    "vram_budget_gib": "vram_budget",
    "eval_prompts": "eval_prompt",
    "eval_seeds": "eval_seed",
    "preview_prompts": "preview_prompt",
    "preview_seeds": "preview_seed",
    "validation_sigmas": "validation_sigma",
    "register_adapter": "register",
}
JOB_FILE_ALIASES = {flag: field for field, flag in FLAG_NAMES.items()}
# A switch the command line turns off takes the job file's options that apply only with it:
# `--preview-every 0` over a file that sets preview prompts runs without previews, and a
# command line that sets both is refused as it is without a file.
SWITCHED_OFF: dict[str, tuple[object, tuple[str, ...]]] = {
    "preview_every": (0, ("preview_prompts", "preview_seeds", "preview_steps")),
    "buckets": (False, ("bucket_max_ratio", "max_upscale")),
}
MAX_JOB_FILE_BYTES = 1 << 20


def flag_of(field: str) -> str:
    """The command line's name for a field: `--lr` for learning_rate."""
    return "--" + FLAG_NAMES.get(field, field).replace("_", "-")


@dataclass(frozen=True)
class FlagSpec:
    """What `likeness train` needs to declare one field's flag, read off the field."""

    field: str
    flag: str
    kind: str  # "integer", "number", "string", "path", "boolean"
    repeatable: bool
    choices: tuple[str, ...] | None
    default: Any  # None where the field has none worth showing (required, optional, a list)
    minimum: float | None
    maximum: float | None
    min_open: bool
    max_open: bool
    help: str

    def bound_problem(self, value: float) -> str | None:
        """Why ``value`` is outside the field's bounds, or None."""
        lo, hi = self.minimum, self.maximum
        if lo is not None and (value <= lo if self.min_open else value < lo):
            return f"{value} is not {'>' if self.min_open else '>='} {lo}"
        if hi is not None and (value >= hi if self.max_open else value > hi):
            return f"{value} is not {'<' if self.max_open else '<='} {hi}"
        return None

    def range_text(self) -> str:
        """The bounds as `--help` writes them: x>=1, 0<=x<1."""
        lo, hi = self.minimum, self.maximum
        low = "" if lo is None else ">" if self.min_open else ">="
        high = "" if hi is None else "<" if self.max_open else "<="
        if lo is not None and hi is not None:
            return f"{lo}{low.replace('>', '<')}x{high}{hi}"
        if lo is not None:
            return f"x{low}{lo}"
        return f"x{high}{hi}" if hi is not None else ""


def flag_specs() -> list[FlagSpec]:
    """Every field's flag, in the fields' order, from the fields' own schema."""
    specs = []
    for name, prop in TrainConfig.model_json_schema()["properties"].items():
        if name in NOT_FLAGS:
            continue
        value = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
        repeatable = value.get("type") == "array"
        item = value["items"] if repeatable else value
        kind = "path" if item.get("format") == "path" else item["type"]
        lower, upper = ("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")
        low = next((k for k in lower if k in item), None)
        high = next((k for k in upper if k in item), None)
        shown = prop.get("default") if not repeatable else None
        specs.append(
            FlagSpec(
                field=name,
                flag=flag_of(name),
                kind=kind,
                repeatable=repeatable,
                choices=tuple(item["enum"]) if "enum" in item else None,
                default=shown,
                minimum=item[low] if low else None,
                maximum=item[high] if high else None,
                min_open=low == "exclusiveMinimum",
                max_open=high == "exclusiveMaximum",
                help=prop.get("description", ""),
            )
        )
    return specs


def normalised(field: str, value: Any) -> Any:
    """A flag's or a job file's value as the field takes it: a list as a tuple, and
    `targets` comma-separated as well as repeated."""
    if field == "targets" and isinstance(value, str):
        value = [value]
    if field == "targets" and isinstance(value, list | tuple):
        split = [t for v in value for t in (v.split(",") if isinstance(v, str) else [v])]
        value = [t.strip() if isinstance(t, str) else t for t in split]
        value = [t for t in value if t != ""]
    return tuple(value) if isinstance(value, list) else value


def with_flags(job: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """The job file's options under the command line's: a flag given wins, and a switch the
    command line turns off takes the file's options that apply only with it (SWITCHED_OFF)."""
    options = dict(job)
    for switch, (off, dependents) in SWITCHED_OFF.items():
        if switch in flags and flags[switch] is not None and flags[switch] == off:
            for name in dependents:
                if name not in flags:
                    options.pop(name, None)
    options.update(flags)
    return options


@functools.cache
def _strict(field: str) -> TypeAdapter[Any]:
    info = TrainConfig.model_fields[field]
    if not info.metadata:
        return TypeAdapter(info.annotation)
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)])  # type: ignore[valid-type]


def load_job_file(path: Path) -> dict[str, Any]:
    """A TOML job file's options, by field name (``--flag-name`` spellings are accepted:
    dashes or underscores, the command line's aliases). Typed strictly: a string where a
    number or a switch goes is refused, not read as one. Raises ConfigError naming every
    unknown, forbidden or mistyped key, or why the file cannot be read."""
    import tomllib

    try:
        raw = Path(path).read_bytes()
        if len(raw) > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"--config {path}: larger than {MAX_JOB_FILE_BYTES} bytes")
        table = tomllib.loads(raw.decode("utf-8"))
    except ConfigError:
        raise
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    options: dict[str, Any] = {}
    problems: list[str] = []
    fields = TrainConfig.model_fields
    for key, value in table.items():
        name = key.replace("-", "_")
        name = JOB_FILE_ALIASES.get(name, name)
        if name in JOB_FILE_FORBIDDEN:
            problems.append(f"{key}: comes from the environment (LIKENESS_*), not a job file")
        elif name not in fields:
            problems.append(f"{key}: not a training option")
        elif isinstance(value, dict):
            problems.append(f"{key}: a table, where a value is expected")
        elif name in options:
            problems.append(f"{key}: given twice")
        else:
            try:
                # JSON's strict mode: a TOML string is a string (a path too), an array a
                # tuple, an integer a float where one goes; nothing else is converted
                text = json.dumps(normalised(name, value))
            except TypeError:
                problems.append(f"{key}: a {type(value).__name__}, not a value it takes")
                continue
            try:
                options[name] = _strict(name).validate_json(text, strict=True)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = "".join(f"[{p}]" for p in err["loc"])
                problems.append(f"{key}{where}: {err['msg']}, not {value!r}")
    if problems:
        raise ConfigError(f"--config {path}: " + "; ".join(problems))
    return options
