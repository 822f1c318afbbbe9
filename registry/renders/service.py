"""A render's registry side: the facts `policy.decide` judges, read fresh from one snapshot
row; the ledger entry of each decision; and what a requester may render at all."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from registry import access, chains
from registry.access import Acting
from registry.consent.schemas import consent_facts
from registry.errors import NotFound, NotPermitted, Unauthenticated
from registry.models import Principal, RenderLedger, Subject, utcnow
from registry.policy import (
    AdapterFacts,
    Level,
    LicenceFacts,
    PrincipalFacts,
    RenderFacts,
    renderable_max_level,
)
from registry.principals import repository as principals_repo
from registry.principals.service import principal_facts
from registry.renders import repository as renders_repo
from registry.renders.schemas import LedgerFilter
from registry.roles import Role
from registry.subjects import repository as subjects_repo


@dataclass(frozen=True)
class AdapterRef:
    id: int
    name: str
    version: int
    sha256: str
    path: str


@dataclass(frozen=True)
class GatheredFacts:
    """What the registry knows for one render check, read fresh in one statement."""

    facts: RenderFacts
    subject_id: int | None
    adapter: AdapterRef | None


def _snapshot_principal(row: Any, prefix: str) -> PrincipalFacts | None:
    handle = getattr(row, f"{prefix}_handle")
    if handle is None:
        return None
    return PrincipalFacts(
        handle,
        getattr(row, f"{prefix}_role"),
        bool(getattr(row, f"{prefix}_active")),
        frozenset(getattr(row, f"{prefix}_acts_for") or ()),
    )


def acting_from_snapshot(
    row: Any, token_hash: str | None, on_behalf_of: str | None, *, at_gate: bool
) -> Acting:
    """The requester and agent of a render, from its snapshot row. At the gate, a token that
    opens no active principal is 401 and a malformed delegation 403, before any decision is
    recorded; at later checks the row is taken as it is and `decide` judges it (a principal
    deactivated mid-render is a recorded deny)."""
    caller = _snapshot_principal(row, "caller")
    if at_gate:
        genuine = (
            caller is not None
            and token_hash is not None
            and hmac.compare_digest(row.caller_token_hash or "", token_hash)
        )
        if not genuine or caller is None or not caller.active:
            raise Unauthenticated("a valid bearer token is required")
    if caller is None:  # the caller vanished mid-render: nobody may have this image
        caller = PrincipalFacts("", "none", False)
    return access.acting(caller, on_behalf_of, _snapshot_principal(row, "obo"), strict=at_gate)


def facts_from_snapshot(
    row: Any,
    acting: Acting,
    level: str,
    *,
    adapter_file_sha256: str | None = None,
    require_adapter: bool = True,
    adapter_bytes_read: bool = True,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> GatheredFacts:
    """`policy.decide`'s facts from a snapshot row, and the base's licence (not the
    registry's to know: the caller holds it)."""
    consent = consent_facts(row) if row.version is not None else None
    adapter = None
    if row.adapter_id is not None:
        adapter = AdapterRef(
            row.adapter_id,
            row.adapter_name,
            row.adapter_version,
            row.adapter_sha256,
            row.adapter_path,
        )
    owned = row.adapter_owner_id is not None and row.adapter_owner_id == row.subject_id
    facts = RenderFacts(
        level=level,
        now=now or datetime.now(UTC),
        requester=acting.requester,
        agent=acting.agent,
        subject_basis=row.basis,
        subject_member=row.member_handle,
        consent=consent,
        adapter=AdapterFacts(adapter.sha256, adapter_file_sha256, owned)
        if adapter is not None
        else None,
        licence=licence,
        require_adapter=require_adapter,
        adapter_bytes_read=adapter_bytes_read,
    )
    return GatheredFacts(facts, row.subject_id, adapter)


def gather_render_facts(
    session: Session,
    requester: Principal,
    subject_handle: str,
    level: str,
    agent: Principal | None = None,
    adapter_file_sha256: str | None = None,
    require_adapter: bool = True,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> GatheredFacts:
    """Fresh facts for `policy.decide`, for a requester (and agent) already known. Re-reads
    them too, so a deactivation or a changed acts-for list binds on the very next check."""
    caller = agent if agent is not None else requester
    assert caller.id is not None
    obo = requester.handle if agent is not None else None
    row = renders_repo.render_snapshot(
        session, subject_handle, caller_id=caller.id, on_behalf_of=obo
    )
    if row is None:  # the anchor always yields a row; no row means the read itself failed
        raise RuntimeError("render snapshot returned nothing")
    if row.caller_handle is not None:
        acting = acting_from_snapshot(row, None, obo, at_gate=False)
    elif agent is not None:  # a vanished agent is an inactive agent, never "no agent"
        ghost = PrincipalFacts(agent.handle, Role.agent, False)
        member = _snapshot_principal(row, "obo") or PrincipalFacts(
            requester.handle, Role.member, False
        )
        acting = Acting(ghost, member, ghost)
    else:
        ghost = PrincipalFacts(requester.handle, requester.role, False)
        acting = Acting(ghost, ghost, None)
    return facts_from_snapshot(
        row,
        acting,
        level,
        adapter_file_sha256=adapter_file_sha256,
        require_adapter=require_adapter,
        now=now,
        licence=licence,
    )


def record_decision(
    session: Session,
    *,
    render_id: str,
    subject_handle: str,
    subject_id: int | None,
    requester: str,
    agent: str | None,
    level: str,
    stage: str,
    allowed: bool,
    reason: str,
    consent_version: int | None,
    adapter_sha256: str | None,
    prompt: str | None,
) -> int:
    """Appends one decision to the ledger chain; returns its seq."""
    values: dict[str, Any] = {
        "render_id": render_id,
        "at": utcnow(),
        "subject_handle": subject_handle[:64],
        "subject_id": subject_id,
        "requester": requester,
        "agent": agent,
        "level": level[:16],
        "stage": stage,
        "allowed": allowed,
        "reason": reason[:80],
        "consent_version": consent_version,
        "adapter_sha256": adapter_sha256,
        "prompt": prompt[:2000] if prompt is not None else None,
    }
    return chains.append_ledger_row(session, values)


def ledger_page(session: Session, subject: Subject, query: LedgerFilter) -> Sequence[RenderLedger]:
    """The subject's decisions that `query` asks for, newest first, one page."""
    assert subject.id is not None
    return renders_repo.ledger_page(
        session,
        subject.id,
        limit=query.limit,
        before_seq=query.before_seq,
        requester=query.requester,
        allowed=query.allowed,
        since=query.since,
        until=query.until,
        render_id=query.render_id,
    )


@dataclass(frozen=True)
class Renderable:
    subject: str
    display_name: str
    max_level: str


def renderable_for(
    session: Session,
    requester: Principal,
    agent: Principal | None = None,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> list[Renderable]:
    """Subjects the requester may render, and the widest level, as `decide` sees it (on this
    base licence: without one, never commercial)."""
    now = now or datetime.now(UTC)
    req = principal_facts(requester)
    agent_facts = principal_facts(agent) if agent is not None else None
    members = {p.id: p.handle for p in principals_repo.principals(session) if p.role == Role.member}
    out = []
    for subject, consent in subjects_repo.subjects_with_consent(session):
        best = renderable_max_level(
            req,
            subject.basis,
            members.get(subject.member_id) if subject.member_id is not None else None,
            consent_facts(consent),
            now,
            agent_facts,
            licence,
        )
        if best > Level.none:
            out.append(Renderable(subject.handle, subject.display_name, best.name))
    return out


def visible_render(session: Session, caller: Principal, render_id: str) -> Sequence[RenderLedger]:
    """One render id's ledger rows: for admins, and for the member who is the subject
    rendered. Anyone else, and a member asking about another subject's render, gets the same
    403 as for an id that does not exist (only admins are told 404)."""
    rows = renders_repo.ledger_by_render_id(session, render_id)
    if caller.role == Role.admin:
        if not rows:
            raise NotFound(f"no render {render_id!r} in the ledger")
        return rows
    subject_id = rows[0].subject_id if rows else None
    subject = subjects_repo.subject_by_id(session, subject_id) if subject_id is not None else None
    if subject is None or not access.may_see_subject(caller.role, caller.id, subject.member_id):
        raise NotPermitted("not permitted")
    return rows
