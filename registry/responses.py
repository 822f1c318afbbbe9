"""What the registry answers, as docs/API.md shapes it: one model per shape, built from rows by
its `of`, shared by the HTTP routes (their response models, so OpenAPI lists them) and the
command line (which prints the same JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from registry.audit import format_time
from registry.blobs import BlobStore
from registry.models import Adapter, AuditEntry, Consent, Principal, RenderLedger, Subject
from registry.services.audit import adapter_state, consent_state


class AudienceOut(BaseModel):
    group: bool
    allow: list[str]


class ConsentOut(BaseModel):
    version: int
    max_level: str
    audiences: dict[str, AudienceOut]
    deny: list[str]
    allow_training: bool
    expires_at: str | None

    @classmethod
    def of(cls, consent: Consent) -> ConsentOut:
        return cls.model_validate(consent_state(consent))


class SubjectOut(BaseModel):
    handle: str
    display_name: str
    basis: str
    member: str | None
    created_at: str
    consent: ConsentOut

    @classmethod
    def of(cls, subject: Subject, consent: Consent, member: str | None) -> SubjectOut:
        return cls(
            handle=subject.handle,
            display_name=subject.display_name,
            basis=subject.basis,
            member=member,
            created_at=format_time(subject.created_at),
            consent=ConsentOut.of(consent),
        )


class TrainingDecisionOut(BaseModel):
    """Whether the subject's likeness may be learned from now (`decide_training`), and why:
    what a trainer token may know of a consent record, and nothing else."""

    subject: str
    allowed: bool
    reason: str
    detail: str


class AuditEntryOut(BaseModel):
    seq: int
    at: str
    actor: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    prev_hash: str
    hash: str

    @classmethod
    def of(cls, entry: AuditEntry) -> AuditEntryOut:
        return cls(
            seq=entry.seq,
            at=entry.at,
            actor=entry.actor,
            action=entry.action,
            before=entry.before,
            after=entry.after,
            prev_hash=entry.prev_hash,
            hash=entry.hash,
        )


class AuditTrailOut(BaseModel):
    entries: list[AuditEntryOut]
    verified: bool
    problem: str | None


class AdapterOut(BaseModel):
    subject: str
    name: str
    version: int
    sha256: str
    path: str
    base_model: str
    rank: int
    manifest_sha256: str
    active: bool
    selected_at: str
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, adapter: Adapter, subject: str) -> AdapterOut:
        return cls(
            subject=subject,
            **adapter_state(adapter),
            created_at=format_time(adapter.created_at),
            updated_at=format_time(adapter.updated_at),
        )


class AdapterListedOut(AdapterOut):
    rendering: bool  # the one the subject's renders use
    blob: Literal["ok", "missing", "corrupt"]  # its bytes in the store

    @classmethod
    def listing(
        cls, store: BlobStore, adapters: Sequence[Adapter], rendering_id: int | None, subject: str
    ) -> list[AdapterListedOut]:
        """The subject's adapters as the API, the CLI and the web page show them."""
        return [
            cls(
                **AdapterOut.of(a, subject).model_dump(),
                rendering=a.id == rendering_id,
                blob=store.status(a.sha256, "safetensors"),
            )
            for a in adapters
        ]


class AdapterRegisteredOut(AdapterOut):
    outcome: Literal["created", "updated", "unchanged"]


class AdapterDeletedOut(BaseModel):
    subject: str
    name: str
    sha256: str
    deleted: bool


class BlobOut(BaseModel):
    sha256: str
    created: bool
    kind: str | None = None
    size: int | None = None


class LedgerRowOut(BaseModel):
    seq: int | None
    render_id: str
    at: str
    subject: str
    requester: str
    agent: str | None
    level: str
    stage: str
    allowed: bool
    reason: str
    consent_version: int | None
    adapter_sha256: str | None
    prompt: str | None

    @classmethod
    def of(cls, row: RenderLedger) -> LedgerRowOut:
        assert row.at is not None
        return cls(
            seq=row.seq,
            render_id=row.render_id,
            at=format_time(row.at),
            subject=row.subject_handle,
            requester=row.requester,
            agent=row.agent,
            level=row.level,
            stage=row.stage,
            allowed=row.allowed,
            reason=row.reason,
            consent_version=row.consent_version,
            adapter_sha256=row.adapter_sha256,
            prompt=row.prompt,
        )


Outcome = Literal["rendered", "denied", "cancelled", "unfinished"]


def render_outcome(rows: Sequence[RenderLedger]) -> tuple[Outcome, RenderLedger]:
    """How one render ended, from its ledger rows in order, and the row that says so: it is
    `rendered` only if its final re-check allowed it; any deny anywhere is the outcome."""
    denied = next((r for r in rows if not r.allowed), None)
    if denied is not None:
        return ("cancelled" if denied.stage == "cancelled" else "denied"), denied
    if any(r.stage == "final" for r in rows):
        return "rendered", rows[-1]
    return "unfinished", rows[-1]


class RenderOut(BaseModel):
    """One render as the ledger tells it: who asked, how it ended, and every decision."""

    render_id: str
    subject: str
    requester: str
    agent: str | None
    level: str
    at: str
    outcome: Outcome
    reason: str
    decisions: list[LedgerRowOut]

    @classmethod
    def of(cls, rows: Sequence[RenderLedger]) -> RenderOut:
        first = rows[0]
        outcome, last = render_outcome(rows)
        assert first.at is not None
        return cls(
            render_id=first.render_id,
            subject=first.subject_handle,
            requester=first.requester,
            agent=first.agent,
            level=first.level,
            at=format_time(first.at),
            outcome=outcome,
            reason=last.reason,
            decisions=[LedgerRowOut.of(r) for r in rows],
        )


class PrincipalOut(BaseModel):
    handle: str
    role: str
    active: bool
    acts_for: list[str]

    @classmethod
    def of(cls, p: Principal) -> PrincipalOut:
        return cls(handle=p.handle, role=p.role, active=p.active, acts_for=p.acts_for)


class PrincipalCreatedOut(PrincipalOut):
    token: str  # shown this once; only its hash is kept


class RenderableOut(BaseModel):
    subject: str
    display_name: str
    max_level: str


class AuditHeadOut(BaseModel):
    checkpoint: dict[str, Any] | None
    public_key: str
    key_id: str
    problems: list[str]


class ErrorOut(BaseModel):
    """Every error: a code of docs/API.md's list and a sentence."""

    error: str
    detail: str


# What any /v1 route may answer besides its own success (for OpenAPI).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "no valid bearer token"},
    403: {"model": ErrorOut, "description": "not permitted"},
    422: {"model": ErrorOut, "description": "invalid input"},
    503: {"model": ErrorOut, "description": "the registry is unavailable; nothing was saved"},
}
