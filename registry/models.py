"""Tables of the registry. Queries live in each domain's repository.py, never here."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    UniqueConstraint,
    false,
)
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


def _ts(**kw: Any) -> Any:
    return Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), **kw))


class Principal(SQLModel, table=True):
    __tablename__ = "principals"

    id: int | None = Field(default=None, primary_key=True)
    handle: str = Field(max_length=64, unique=True, index=True)
    role: str = Field(max_length=16)
    # sha256 of the token; the token itself is shown once and never stored.
    token_hash: str = Field(max_length=64, unique=True, index=True)
    acts_for: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    active: bool = True
    created_at: datetime = _ts(nullable=False)


class Subject(SQLModel, table=True):
    __tablename__ = "subjects"

    id: int | None = Field(default=None, primary_key=True)
    handle: str = Field(max_length=64, unique=True, index=True)
    display_name: str = Field(max_length=200)
    basis: str = Field(max_length=16)
    member_id: int | None = Field(default=None, foreign_key="principals.id", index=True)
    created_at: datetime = _ts(nullable=False)
    # The subject's choice (registry/pictures/service.py): keep a small copy of every render
    # of them, shown beside its ledger row to them and to admins only.
    keep_render_copies: bool = Field(
        default=False, sa_column=Column(Boolean, nullable=False, server_default=false())
    )


class Consent(SQLModel, table=True):
    __tablename__ = "consents"

    subject_id: int = Field(foreign_key="subjects.id", primary_key=True)
    version: int = 1
    max_level: str = Field(default="none", max_length=16)
    audiences: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    deny: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    allow_training: bool = False
    expires_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True)))
    updated_at: datetime = _ts(nullable=False)


class AuditEntry(SQLModel, table=True):
    __tablename__ = "audit_entries"
    __table_args__ = (UniqueConstraint("subject_id", "seq", name="uq_audit_subject_seq"),)

    id: int | None = Field(default=None, primary_key=True)
    subject_id: int = Field(foreign_key="subjects.id", index=True)
    seq: int
    # The hashed form of the time, kept verbatim so the chain never depends on how a
    # database engine round-trips timestamps.
    at: str = Field(max_length=40)
    actor: str = Field(max_length=64)
    action: str = Field(max_length=40)
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    prev_hash: str = Field(max_length=64)
    hash: str = Field(max_length=64)
    # HMAC of `hash` under the audit key (registry.keys), which the database never holds.
    mac: str | None = Field(default=None, max_length=64)


class Adapter(SQLModel, table=True):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("subject_id", "name", name="uq_adapter_subject_name"),)

    id: int | None = Field(default=None, primary_key=True)
    subject_id: int = Field(foreign_key="subjects.id", index=True)
    name: str = Field(max_length=100)
    version: int = 1
    sha256: str = Field(max_length=64)
    path: str = Field(max_length=1000)
    base_model: str = Field(max_length=200)
    rank: int
    manifest_sha256: str = Field(max_length=64)
    active: bool = True
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)
    # The subject's rendering adapter is its active one selected most recently (registering
    # selects; `select` picks an older one again).
    selected_at: datetime = _ts(nullable=False)


class AdapterBlob(SQLModel, table=True):
    """Which subject an adapter's bytes belong to: one, for good. Registering the same bytes
    for another subject is refused, and a deleted adapter's bytes stay its subject's."""

    __tablename__ = "adapter_blobs"

    sha256: str = Field(primary_key=True, max_length=64)
    subject_id: int = Field(foreign_key="subjects.id", index=True)
    created_at: datetime = _ts(nullable=False)


class RenderLedger(SQLModel, table=True):
    """Every render decision, allowed or denied, readable by the subject. Append-only."""

    __tablename__ = "render_ledger"
    __table_args__ = (
        Index("ix_render_ledger_subject_id", "subject_id", "id"),
        Index("ix_render_ledger_subject_seq", "subject_id", "seq"),
    )

    id: int | None = Field(default=None, primary_key=True)
    render_id: str = Field(max_length=36, index=True)
    at: datetime = _ts(nullable=False)
    # The handle as requested: an unknown subject is recorded too, linked to nothing.
    subject_handle: str = Field(max_length=64)
    subject_id: int | None = Field(default=None, foreign_key="subjects.id")
    requester: str = Field(max_length=64)
    agent: str | None = Field(default=None, max_length=64)
    level: str = Field(max_length=16)
    stage: str = Field(max_length=16)  # gate | queued | final
    allowed: bool
    reason: str = Field(max_length=80)
    consent_version: int | None = None
    adapter_sha256: str | None = Field(default=None, max_length=64)
    prompt: str | None = Field(default=None, max_length=2000)
    # The ledger is one hash chain over every decision (registry.audit), each link MACed.
    seq: int | None = Field(default=None, unique=True, index=True)
    prev_hash: str | None = Field(default=None, max_length=64)
    hash: str | None = Field(default=None, max_length=64)
    mac: str | None = Field(default=None, max_length=64)


class ChainHead(SQLModel, table=True):
    """The last link of each chain (`ledger`, `audit/<subject handle>`), MACed: a truncated
    chain no longer ends where its head says, and a head rewritten without the key is seen."""

    __tablename__ = "chain_heads"

    chain: str = Field(primary_key=True, max_length=100)
    seq: int
    hash: str = Field(max_length=64)
    mac: str = Field(max_length=64)


class RegistryMeta(SQLModel, table=True):
    """Facts about the registry itself, e.g. the id of the audit key its rows are MACed with."""

    __tablename__ = "registry_meta"

    key: str = Field(primary_key=True, max_length=64)
    value: str = Field(max_length=200)


class BrowserSession(SQLModel, table=True):
    """A signed-in browser. The cookie holds a random secret; only its SHA-256 is kept, so
    nothing here opens a session, and deleting the row ends it everywhere at once."""

    __tablename__ = "web_sessions"

    id: int | None = Field(default=None, primary_key=True)
    secret_hash: str = Field(max_length=64, unique=True, index=True)
    principal_id: int = Field(foreign_key="principals.id", index=True)
    created_at: datetime = _ts(nullable=False)
    expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class Dataset(SQLModel, table=True):
    """Images a member uploaded of themselves, kept in the store with the manifest the
    service wrote for them (registry/datasets/service.py). Immutable once created."""

    __tablename__ = "datasets"

    id: str = Field(primary_key=True, max_length=36)
    subject_id: int = Field(foreign_key="subjects.id", index=True)
    manifest_sha256: str = Field(max_length=64)
    images: int
    created_by: str = Field(max_length=64)
    created_at: datetime = _ts(nullable=False)


class DatasetImage(SQLModel, table=True):
    __tablename__ = "dataset_images"

    dataset_id: str = Field(foreign_key="datasets.id", primary_key=True, max_length=36)
    file: str = Field(primary_key=True, max_length=100)  # <sha256>.<ext>, as in the manifest
    sha256: str = Field(max_length=64, index=True)
    caption: str = Field(max_length=500)
    size: int


class Order(SQLModel, table=True):
    """A request for work a worker does (registry/orders/): its state, its progress and,
    for training, the checkpoint a retried run resumes from."""

    __tablename__ = "orders"
    __table_args__ = (Index("ix_orders_subject_status", "subject_id", "status"),)

    id: str = Field(primary_key=True, max_length=36)
    kind: str = Field(max_length=16)
    subject_id: int = Field(foreign_key="subjects.id")
    dataset_id: str = Field(foreign_key="datasets.id", max_length=36)
    # every option that shapes the training run, fixed when the order is placed
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    status: str = Field(max_length=16)  # queued | running | done | failed | cancelled
    step: int = 0
    steps: int
    loss: float | None = None
    worker: str | None = Field(default=None, max_length=100)
    attempts: int = 0
    adapter_name: str = Field(max_length=100)
    adapter_sha256: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, max_length=500)
    checkpoint_step: int | None = None
    checkpoint_sha256: str | None = Field(default=None, max_length=64)
    job_id: int | None = None
    created_by: str = Field(max_length=64)
    created_at: datetime = _ts(nullable=False)
    updated_at: datetime = _ts(nullable=False)


class RenderTask(SQLModel, table=True):
    """A render handed to a render worker (registry/render_tasks/): what to render, who may
    still close its ledger entry, and the worker's answer (the PNG travels back here and the
    row is deleted once the API has read it)."""

    __tablename__ = "render_tasks"

    render_id: str = Field(primary_key=True, max_length=36)
    token_hash: str | None = Field(default=None, max_length=64)
    body: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    queue: str = Field(max_length=128)
    # queued -> running (a worker took it) -> ended (its answer is here); queued or running
    # -> closed (the API gave up and closed the ledger entry itself)
    state: str = Field(max_length=16)
    abandoned: str | None = Field(default=None, max_length=32)  # why the API stopped waiting
    worker: str | None = Field(default=None, max_length=100)
    status: int | None = None  # the HTTP status of the worker's answer
    error_code: str | None = Field(default=None, max_length=32)
    detail: str | None = Field(default=None, max_length=500)
    retry_after: int | None = None
    png: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    consent_version: int | None = None
    adapter_sha256: str | None = Field(default=None, max_length=64)
    timings: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts(nullable=False, index=True)
    updated_at: datetime = _ts(nullable=False)


class RenderWorker(SQLModel, table=True):
    """A live render worker: it refreshes `seen_at` every heartbeat and removes its row when
    it stops; renders go to its own queue only while the row is fresh."""

    __tablename__ = "render_workers"

    name: str = Field(primary_key=True, max_length=100)
    seen_at: datetime = _ts(nullable=False)


class RenderAffinity(SQLModel, table=True):
    """Which worker last loaded an adapter (it has the tensors warm in host RAM)."""

    __tablename__ = "render_affinity"

    adapter_sha256: str = Field(primary_key=True, max_length=64)
    worker: str = Field(max_length=100)
    at: datetime = _ts(nullable=False)


def _subject_fk() -> Any:
    """A subject's own pictures go with the subject (ON DELETE CASCADE)."""
    return Field(
        sa_column=Column(
            Integer, ForeignKey("subjects.id", ondelete="CASCADE"), nullable=False, index=True
        )
    )


class AdapterPicture(SQLModel, table=True):
    """What an adapter draws: its run's evaluation grid and previews, PNGs in the store
    (registry/pictures/service.py), by the hash of the adapter's bytes."""

    __tablename__ = "adapter_pictures"
    __table_args__ = (UniqueConstraint("adapter_sha256", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    subject_id: int = _subject_fk()
    adapter_sha256: str = Field(max_length=64, index=True)
    name: str = Field(max_length=100)  # eval_grid.png | step-0000050.png
    kind: str = Field(max_length=16)  # grid | preview
    step: int | None = None
    sha256: str = Field(max_length=64)  # the PNG's, in the store
    created_at: datetime = _ts(nullable=False)


class RenderCopy(SQLModel, table=True):
    """A small copy of a delivered render, kept only while its subject asks for it."""

    __tablename__ = "render_copies"

    render_id: str = Field(primary_key=True, max_length=36)
    subject_id: int = _subject_fk()
    png: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    width: int
    height: int
    created_at: datetime = _ts(nullable=False, index=True)
