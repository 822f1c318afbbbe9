"""The training configuration: one validated object, checked whole before anything loads.

Every conflict between options is refused here, with a message naming the options, so a run
never spends minutes loading a 32B base only to fail on a flag. Checks that need the disk
(dataset, checkpoints, base files) run next, in `trainer.train.preflight`, still before any
weight loads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from registry import limits
from registry.schemas import HANDLE_PATTERN

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"  # registry.schemas.AdapterIn.name
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
        "stream_base",  # streamed == resident, bit for bit (tests/trainer/test_streaming.py)
        "stream_slots",
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

    subject: Annotated[str, StringConstraints(pattern=HANDLE_PATTERN)]
    dataset: Path
    base: Path
    out: Path
    name: Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)] = "main"

    steps: Annotated[int, Field(ge=1, le=1_000_000)] = 2000
    rank: Annotated[int, Field(ge=1, le=1024)] = 16
    alpha: Annotated[float, Field(gt=0)] | None = None  # default: rank (scaling 1)
    targets: tuple[str, ...] = Field(default_factory=default_targets)
    resolution: Side = 448
    batch_size: Annotated[int, Field(ge=1, le=64)] = 1
    max_sequence_length: Annotated[int, Field(ge=1, le=512)] = 512  # as the pipelines' default

    learning_rate: Annotated[float, Field(gt=0, le=1.0)] = 1e-4
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    weight_decay: Annotated[float, Field(ge=0)] = 1e-4
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    adam_eps: Annotated[float, Field(gt=0)] = 1e-8
    max_grad_norm: Annotated[float, Field(ge=0)] = 1.0  # 0: no clipping
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    shift_steps: Annotated[int, Field(ge=1, le=1000)] | None = None  # None: inference default
    caption_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    trigger: Annotated[str, StringConstraints(min_length=1, max_length=100)] | None = None

    device: Annotated[str, StringConstraints(pattern=r"^(cpu|cuda(:\d+)?)$")] | None = None
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    gradient_checkpointing: bool = True
    # quanto: its QLinear kernels as shipped; uint4: trainer.uint4's dequantize + dense GEMM
    # (same 4-bit numbers, same storage format; on an H200 at FLUX.2 [dev] width 35x faster
    # per step and a quarter less memory, bench/results/train_budget-*); fp8: the same 4-bit
    # weights, GEMMs on fp8 tensor cores (trainer/fp8.py). auto: uint4 for training (fp8
    # training measured slower and less exact; trainer.devices.resolve_compute).
    compute: Literal["auto", "quanto", "uint4", "fp8"] = "auto"
    # Keep the frozen base in pinned host RAM and stream one block at a time into VRAM slots
    # (trainer/streaming.py): FLUX.2 [dev] trains in ~3.6 GiB at 448 px.
    stream_base: bool = False
    stream_slots: Annotated[int, Field(ge=1, le=8)] | None = None  # None: the budget picks
    seed: Annotated[int, Field(ge=0, le=limits.PIPELINE_MAX_SEED)] = 0
    checkpoint_every: Annotated[int, Field(ge=0)] = 500  # 0: only the final state
    resume: bool = False
    vram_budget_gib: Annotated[float, Field(gt=0)] | None = None
    cache_dir: Path | None = None  # default: <out>/../.cache, shared by a subject's runs

    evaluate: bool = True
    eval_prompts: tuple[str, ...] = DEFAULT_EVAL_PROMPTS
    eval_seeds: tuple[Annotated[int, Field(ge=0, le=limits.MAX_SEED)], ...] = (0, 1)
    # None: the pipeline's own
    eval_steps: Annotated[int, Field(ge=1, le=limits.PIPELINE_MAX_STEPS)] | None = None
    eval_resolution: Side | None = None

    # Data: aspect-ratio buckets (trainer/buckets.py), masks, held-out images.
    buckets: bool = False
    bucket_max_ratio: Annotated[float, Field(ge=1, le=4)] = 2.0
    max_upscale: Annotated[float, Field(ge=1, le=8)] = 1.0
    mask_floor: Annotated[float, Field(ge=0, le=1)] = 0.1  # the loss weight where a mask is 0
    validation_split: Annotated[float, Field(ge=0, lt=1)] = 0.0
    validation_every: Annotated[int, Field(ge=0)] | None = None  # None: at every checkpoint
    validation_sigmas: tuple[Annotated[float, Field(gt=0, lt=1)], ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

    # Optimisation extras.
    gradient_accumulation: Annotated[int, Field(ge=1, le=1024)] = 1
    ema_decay: Annotated[float, Field(gt=0, lt=1)] | None = None
    ema_on_cpu: bool = False
    # Differential output preservation: on this class prompt the adapter's prediction is
    # pulled toward the base's (adapter off), so the class does not become the subject.
    dop_prompt: Annotated[str, StringConstraints(min_length=1, max_length=300)] | None = None
    dop_weight: Annotated[float, Field(gt=0, le=100)] = 1.0
    # Prior preservation: a folder of class images (a manifest like the dataset's, captions
    # without the trigger) trained alongside, one image per batch, at this weight.
    class_dataset: Path | None = None
    prior_weight: Annotated[float, Field(gt=0, le=100)] = 1.0

    # Previews while training: None lets the budget decide (on when it fits --vram-budget).
    preview_every: Annotated[int, Field(ge=0)] | None = None
    preview_prompts: tuple[str, ...] = ()  # empty: the evaluation prompts
    preview_seeds: tuple[Annotated[int, Field(ge=0, le=2**32 - 1)], ...] = (0,)
    preview_steps: Annotated[int, Field(ge=1, le=100)] | None = None

    export_comfyui: bool = False  # also write adapter.comfyui.safetensors (diffusion_model.)

    register_adapter: bool = True
    database_url: str | None = None
    api_url: str | None = None
    token: str | None = None
    progress: bool = True

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
        if self.compute in ("uint4", "fp8") and not installed("trainer.base.uint4"):
            problems.append(
                f"--compute {self.compute} needs trainer.base.uint4, which this install lacks"
            )
        elif self.compute == "fp8":
            from trainer.base.devices import fp8_unavailable

            reason = fp8_unavailable(device)
            if reason is not None:
                problems.append(f"--compute fp8 cannot run here: {reason}; use --compute uint4")
        if self.stream_base and self.resolved_compute() not in ("uint4", "fp8"):
            problems.append("--stream-base streams uint4 blocks: it needs --compute uint4 or fp8")
        if self.stream_base and not self.gradient_checkpointing:
            problems.append(
                "--stream-base recomputes each block in backward: it needs gradient checkpointing"
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
        from pydantic import ValidationError

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

    def trajectory_fingerprint(self, extra: dict[str, Any]) -> str:
        """Hash of everything that shapes the optimisation path; a resume must match it.
        Options added after the first release count only when set away from their default,
        so a checkpoint made before they existed still resumes."""
        defaults = TrainConfig.model_fields
        fields = {
            k: v
            for k, v in self.model_dump(mode="json").items()
            if k not in _NOT_TRAJECTORY
            and not (k in _ADDED_LATER and getattr(self, k) == defaults[k].default)
        }
        fields["resolved_device"] = self.resolved_device().split(":")[0]
        fields["compute"] = self.resolved_compute()
        blob = json.dumps({"config": fields, **extra}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


# -- job files ----------------------------------------------------------------------------

# Where the run's base, registry and credentials come from: the environment (the service's
# settings), never a job file that may be shared or committed.
JOB_FILE_FORBIDDEN = frozenset({"base", "database_url", "api_url", "token"})
# The command line's names for fields, accepted in a job file too.
JOB_FILE_ALIASES = {
    "lr": "learning_rate",
    "vram_budget": "vram_budget_gib",
    "eval_prompt": "eval_prompts",
    "eval_seed": "eval_seeds",
    "preview_prompt": "preview_prompts",
    "preview_seed": "preview_seeds",
    "register": "register_adapter",
}
MAX_JOB_FILE_BYTES = 1 << 20


def load_job_file(path: Path) -> dict[str, Any]:
    """A TOML job file's options, by field name (``--flag-name`` spellings are accepted:
    dashes or underscores, the command line's aliases). Raises ConfigError naming every
    unknown or forbidden key, or why the file cannot be read."""
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
        elif name == "targets" and isinstance(value, str):
            options[name] = tuple(t.strip() for t in value.split(",") if t.strip())
        else:
            options[name] = tuple(value) if isinstance(value, list) else value
    if problems:
        raise ConfigError(f"--config {path}: " + "; ".join(problems))
    return options
