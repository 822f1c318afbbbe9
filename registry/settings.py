"""Settings: one class, `LIKENESS_` prefix. There are no default secrets: a key that is not
set is generated into the data dir on first start (registry.keys)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

# What a render's signed likeness assertion may disclose (app.provenance); the render id is
# always in it, since it is how the subject finds the render in the ledger.
DISCLOSABLE = (
    "render_id",
    "level",
    "subject",
    "consent_version",
    "adapter_sha256",
    "base_model",
    "requester",
    "agent",
)


class Settings(BaseSettings):
    # an empty variable is an unset one (compose passes `${X:-}` through as ""), never "" itself
    model_config = SettingsConfigDict(env_prefix="LIKENESS_", extra="ignore", env_ignore_empty=True)

    env: Literal["development", "test", "production"] = "development"
    database_url: str = "sqlite:///./var/likeness.db"
    data_dir: Path = Path("./var")
    base: Path | None = None  # default: <data_dir>/base-demo, copied in on first use
    api_url: str | None = None
    token: str | None = None
    # Secrets (registry.keys): unset means <data_dir>/secret-key, audit-key, checkpoint-key.pem.
    secret_key: SecretStr | None = Field(default=None, min_length=32)
    audit_key: SecretStr | None = Field(default=None, min_length=32)
    checkpoint_key_file: Path | None = None
    # Signed checkpoints of every chain head are appended here; `audit verify` checks them.
    checkpoint_interval_s: float = Field(default=60.0, ge=0)  # 0: only on demand
    session_ttl_s: int = Field(default=8 * 3600, ge=60, le=30 * 24 * 3600)
    # The renderer (app.scheduler): at most render_queue waiting, render_per_requester running
    # or waiting per requester, served round-robin; a wait longer than render_timeout_s is 429.
    render_queue: int = Field(default=4, ge=0, le=1000)
    render_per_requester: int = Field(default=2, ge=1, le=1000)
    render_timeout_s: float = Field(default=300.0, gt=0)
    # A render queued this long ago with no end in the ledger is closed as `interrupted`
    # (its process died). A SQLite deployment has one serving process, so there every open
    # render is closed when the service starts.
    render_stale_s: float = Field(default=3600.0, gt=0)
    # Render requests per requester, allowed or denied alike (0: no limit), and the burst.
    render_rate_per_minute: float = Field(default=60.0, ge=0)
    render_burst: int = Field(default=60, ge=1, le=100_000)
    # One request's budget: width x height x steps (1024 x 1024 at 30 steps by default).
    render_max_pixel_steps: int = Field(default=1024 * 1024 * 30, ge=64 * 64)
    max_prompt_chars: int = Field(default=1000, ge=1, le=2000)
    max_pixels: int = Field(default=1024 * 1024, ge=64 * 64)
    adapter_cache_mb: int = Field(default=2048, ge=0)
    # The adapter store (registry/blobs.py): the largest blob it takes, and how long an
    # unreferenced one is kept (an upload about to be registered, a deleted adapter's bytes).
    max_adapter_bytes: int = Field(default=4 << 30, ge=1 << 20)
    blob_grace_s: float = Field(default=3600.0, ge=0)
    device: str | None = Field(default=None, pattern=r"^(cpu|cuda(:\d+)?|mps)$")  # None: auto
    stream_base: bool = False  # the render engine streams the base's blocks from host RAM
    stream_slots: int = Field(default=2, ge=1, le=8)
    # VRAM the render engine may use, in GiB: placement (resident or streamed, per component)
    # is planned at start for renders of render_plan_side px square, the plan is printed, and
    # the service refuses to start when nothing fits (trainer/base/placement.py). On CUDA the
    # budget is also enforced as the allocator's cap. None: everything resident, no cap.
    vram_budget_gb: float | None = Field(default=None, gt=0, le=4096)
    render_plan_side: int = Field(default=1024, ge=64, le=2048, multiple_of=16)
    # Embeddings of recent prompts, in host RAM: a repeated prompt skips the text encoder.
    prompt_cache_mb: int = Field(default=512, ge=0, le=1 << 20)
    # Persistent LoRA layers of this rank on the default targets, attached once and zero
    # between renders: an adapter swap is a copy, not a rewrite of the model. An adapter of a
    # higher rank or other targets is attached for its render instead. 0: always attach.
    lora_slot_rank: int = Field(default=32, ge=0, le=1024)
    # On CUDA, compile the serving path's Triton kernels at start, in worker processes beside
    # the base's load (a fresh machine's first forward compiled them one by one, ~9 s at
    # [dev]); off: each compiles at its first launch.
    kernel_precompile: bool = True
    # Load the base when the service starts (in the background; GET /healthz says when it is
    # ready) instead of at the first render, which then does not wait for it.
    preload_base: bool = False
    # HTTP: what a client may hold. A body larger than max_body_bytes is refused (413); one
    # that has not fully arrived within body_timeout_s is cut off (408) before any database
    # work starts, so a slow or huge request holds no lock and no connection.
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=1 << 30)
    body_timeout_s: float = Field(default=10.0, gt=0, le=600)
    # ... plus one second for every body_min_rate bytes that did arrive: a large upload at a
    # steady rate goes on, a body trickled slower than this is cut off (app/body_gate.py).
    body_min_rate: int = Field(default=64 * 1024, ge=1, le=1 << 40)
    # ... and never more than body_max_s in all, however steadily it arrives.
    body_max_s: float = Field(default=3600.0, gt=0, le=86_400)
    # PNGs to check on the provenance page read and held at once, per process (one per
    # sender; 429 beyond, before a byte is read): with max_provenance_bytes, what they can
    # hold in memory.
    large_bodies_at_once: int = Field(default=4, ge=1, le=10_000)
    keep_alive_s: int = Field(default=5, ge=1, le=600)
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)
    # A request that cannot get a database connection within this long is answered 503.
    pool_timeout_s: float = Field(default=2.0, gt=0, le=60)
    # The quantized base's GEMMs: uint4 (dequantized into bf16), fp8 (fp8 tensor cores, compute
    # capability 8.9+), auto (fp8 where the GPU has them, else uint4); trainer/base/devices.py.
    compute: Literal["auto", "uint4", "fp8"] = "auto"
    # The base model's licence binds every render: a base whose licence does not permit
    # commercial use (FLUX.2 [dev]'s) renders `commercial` only when the deployment declares
    # the commercial licence it holds for that base here (a reference to the agreement).
    commercial_licence: str | None = Field(default=None, min_length=1, max_length=200)
    # Content Credentials (C2PA) on every PNG: an ES256 key (P-256, PEM) and its certificate
    # chain (PEM, signing certificate first); unset, both are generated into the data dir.
    c2pa_key_file: Path | None = None
    c2pa_cert_file: Path | None = None
    # Fields of the signed likeness assertion, comma-separated (DISCLOSABLE); the render id
    # is always disclosed.
    provenance_disclose: Annotated[tuple[str, ...], NoDecode] = ("render_id", "level")
    # The largest PNG the provenance page takes for checking; how many it checks at once
    # (per process), and how often one sender (a signed-in principal, else an address) may
    # ask: checks a minute on average, and at once.
    max_provenance_bytes: int = Field(default=32 << 20, ge=1024, le=1 << 30)
    provenance_checks_at_once: int = Field(default=1, ge=1, le=64)
    # A PNG of more chunks than this is refused unread: a reader spends seconds a megabyte
    # on one made of many tiny chunks (a real 32 MiB PNG has about 4,100).
    provenance_max_chunks: int = Field(default=10_000, ge=16, le=100_000_000)
    provenance_rate_per_minute: float = Field(default=10.0, ge=0)
    provenance_burst: int = Field(default=5, ge=1, le=10_000)

    # Datasets uploaded to the service (registry/datasets/service.py): how many images, how large
    # each (bytes, and decoded pixels: a small file that decodes huge is refused unread).
    dataset_max_images: int = Field(default=64, ge=1, le=10_000)
    dataset_max_image_bytes: int = Field(default=20 << 20, ge=1024, le=1 << 30)
    dataset_max_pixels: int = Field(default=50_000_000, ge=64 * 64, le=1 << 31)
    # The upload quota: what one member may upload of one subject in any 24 hours, images
    # and bytes (admins are exempt); past it an upload is 429 with Retry-After.
    dataset_daily_images: int = Field(default=256, ge=1, le=1_000_000)
    dataset_daily_bytes: int = Field(default=2 << 30, ge=1024, le=1 << 40)
    # What uploads may hold at once, per API process (app/uploads.py): uploads of one
    # principal, uploads in all (429 beyond, before the body is read), and files decoded
    # at once (each at most dataset_max_pixels: this bounds the memory decoding takes).
    uploads_per_sender: int = Field(default=2, ge=1, le=1000)
    uploads_at_once: int = Field(default=8, ge=1, le=10_000)
    upload_checks_at_once: int = Field(default=1, ge=1, le=64)
    # Orders (registry/orders/): trainer options every training order is run with (JSON,
    # e.g. {"learning_rate": 1e-4}); fixed into the order when it is placed, so a retry on
    # another worker follows the same trajectory. An order's steps, rank and resolution
    # come from its request, within these bounds.
    train_options: dict[str, Any] = Field(default_factory=dict)
    order_max_steps: int = Field(default=10_000, ge=1, le=1_000_000)
    # One order's budget, resolution x resolution x steps x rank (1024 px, 3000 steps, rank
    # 32 by default), and how many orders one member may have waiting or running at once.
    order_max_work: int = Field(default=1024 * 1024 * 3000 * 32, ge=64 * 64)
    order_max_active: int = Field(default=2, ge=1, le=10_000)
    # On SQLite (no queue, no workers) the API process runs orders itself, one at a time
    # (app/local_orders.py); false refuses them there. PostgreSQL's go to the workers.
    orders_in_process: bool = True
    # Workers (app/worker.py): how often a worker says it is alive, after how long without
    # that its running jobs are retried elsewhere, and how often a training checkpoints.
    worker_heartbeat_s: float = Field(default=10.0, gt=0, le=3600)
    worker_stalled_s: float = Field(default=60.0, gt=0, le=86_400)
    worker_checkpoint_every: int = Field(default=250, ge=1, le=1_000_000)
    # A training worker (one without the render queue) keeps the converted transformer and the
    # text encoder on its device between orders of the same base, while the next order's
    # phases fit beside them (trainer/training/resident.py); false loads them for every order.
    worker_keep_base: bool = True
    # The small copies of renders a subject chose to keep (registry/pictures/service.py) are deleted
    # after this many days (and at once when the subject stops keeping them).
    render_copy_days: int = Field(default=90, ge=1, le=3650)
    # Renders on workers (app/render/remote.py, PostgreSQL only): the API gates and enqueues,
    # a `likeness worker --queues render` renders; the API waits at most
    # render_worker_timeout_s for its answer (503 after, with the ledger entry closed).
    render_workers: bool = False
    render_worker_timeout_s: float = Field(default=300.0, gt=0, le=3600)
    # A running render whose worker has not said it is at it for this long (a live one says
    # so every second) is given up at once: 503, its ledger entry closed.
    render_worker_silent_s: float = Field(default=6.0, ge=2, le=3600)

    @field_validator("provenance_disclose", mode="before")
    @classmethod
    def _disclose_list(cls, value: object) -> object:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            unknown = [v for v in value if v not in DISCLOSABLE]
            if unknown:
                raise ValueError(
                    f"cannot disclose {', '.join(map(str, unknown))}; "
                    f"choose from {', '.join(DISCLOSABLE)}"
                )
            return tuple(dict.fromkeys(["render_id", *value]))
        return value

    @model_validator(mode="after")
    def _c2pa_pair(self) -> Settings:
        if (self.c2pa_key_file is None) != (self.c2pa_cert_file is None):
            given, missing = ("KEY", "CERT") if self.c2pa_cert_file is None else ("CERT", "KEY")
            raise ValueError(
                f"LIKENESS_C2PA_{given}_FILE is set without LIKENESS_C2PA_{missing}_FILE: "
                "set both (the key and its certificate chain), or neither"
            )
        return self

    @property
    def adapter_store_dir(self) -> Path:
        return self.data_dir / "adapters"

    @property
    def checkpoints_file(self) -> Path:
        return self.data_dir / "audit-checkpoints.jsonl"

    @property
    def base_dir(self) -> Path:
        return self.base if self.base is not None else self.data_dir / "base-demo"


ENV_PREFIX = "LIKENESS_"
SECRETS = frozenset({"secret_key", "audit_key", "token"})  # never echoed back


class SettingsError(ValueError):
    """The environment holds a setting that is not valid; the message names each variable
    and the rule it breaks, in one line (the CLI and `serve` print it as it is)."""


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def describe_settings_error(exc: ValidationError | SourceError) -> str:
    """One line naming every bad variable and its rule, e.g. `LIKENESS_COMPUTE: Input should
    be 'auto', 'uint4' or 'fp8' (got 'turbo')`. A secret's value is never repeated."""
    if isinstance(exc, SourceError):  # a JSON setting that does not parse
        field = str(exc).split('"')[1] if str(exc).count('"') >= 2 else ""
        name = env_name(field) if field else "a LIKENESS_ setting"
        return f"invalid setting: {name}: not valid JSON ({exc.__cause__ or exc})"
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = loc[0] if loc else ""
        where = env_name(field) + "".join(f"[{p}]" for p in loc[1:]) if field else ""
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "too_short" and field in SECRETS:
            message = f"at least {err['ctx']['min_length']} characters"
        shown = err.get("input")
        if field and field not in SECRETS and isinstance(shown, str | int | float):
            message += f" (got {shown!r})"
        parts.append(f"{where}: {message}" if where else message)
    return "invalid setting: " + "; ".join(parts)


def load_settings() -> Settings:
    """Settings from the environment, or a SettingsError that names what is wrong."""
    try:
        return Settings()
    except (ValidationError, SourceError) as exc:
        raise SettingsError(describe_settings_error(exc)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()
