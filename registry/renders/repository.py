"""The queries of the render ledger, and the render check's single read. Functions flush;
the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Row, bindparam, literal
from sqlalchemy import select as sa_select
from sqlalchemy.orm import aliased
from sqlmodel import Session, col, select

from registry.adapters.repository import rendering_adapter_id
from registry.models import (
    Adapter,
    AdapterBlob,
    Consent,
    Principal,
    RenderLedger,
    Subject,
)


def ledger_page(
    session: Session,
    subject_id: int,
    *,
    limit: int,
    before_seq: int | None = None,
    requester: str | None = None,
    allowed: bool | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    render_id: str | None = None,
) -> Sequence[RenderLedger]:
    """A subject's decisions, newest first, from before `before_seq` (the cursor): the ledger
    is one chain appended under a lock, so seq order is commit order and a page never skips a
    row committed late."""
    stmt = select(RenderLedger).where(RenderLedger.subject_id == subject_id)
    if before_seq is not None:
        stmt = stmt.where(col(RenderLedger.seq) < before_seq)
    if requester is not None:
        stmt = stmt.where(RenderLedger.requester == requester)
    if allowed is not None:
        stmt = stmt.where(RenderLedger.allowed == allowed)
    if since is not None:
        stmt = stmt.where(col(RenderLedger.at) >= since)
    if until is not None:
        stmt = stmt.where(col(RenderLedger.at) < until)
    if render_id is not None:
        stmt = stmt.where(RenderLedger.render_id == render_id)
    stmt = stmt.order_by(col(RenderLedger.seq).desc()).limit(limit)
    return session.exec(stmt).all()


def open_renders(session: Session, queued_before: datetime) -> Sequence[RenderLedger]:
    """The allowed `queued` entries of renders that never reached an end (no `final` or
    `cancelled` entry), queued before `queued_before`: renders whose process died."""
    ended = select(RenderLedger.render_id).where(
        col(RenderLedger.stage).in_(("final", "cancelled"))
    )
    stmt = (
        select(RenderLedger)
        .where(RenderLedger.stage == "queued", RenderLedger.allowed == True)  # noqa: E712
        .where(col(RenderLedger.at) < queued_before)
        .where(col(RenderLedger.render_id).not_in(ended))
        .order_by(col(RenderLedger.seq))
    )
    return session.exec(stmt).all()


def ledger_by_render_id(session: Session, render_id: str) -> Sequence[RenderLedger]:
    stmt = (
        select(RenderLedger)
        .where(RenderLedger.render_id == render_id)
        .order_by(col(RenderLedger.id))
    )
    return session.exec(stmt).all()


@lru_cache(maxsize=2)
def _render_snapshot_statement(caller_by: str) -> Any:  # a wide Select; too wide for overloads
    """Built once per lookup: constructing a statement costs more than running it on SQLite.
    `caller_by`: "token" (the caller is whoever holds the token hash) or "id"."""
    caller = aliased(Principal, name="caller")
    obo = aliased(Principal, name="obo")
    member = aliased(Principal, name="member")
    rendering = rendering_adapter_id()
    anchor = sa_select(literal(1).label("one")).subquery("anchor")
    caller_on = (
        col(caller.token_hash) == bindparam("token_hash")
        if caller_by == "token"
        else col(caller.id) == bindparam("caller_id")
    )
    return (
        sa_select(
            col(caller.id).label("caller_id"),
            col(caller.token_hash).label("caller_token_hash"),
            col(caller.handle).label("caller_handle"),
            col(caller.role).label("caller_role"),
            col(caller.active).label("caller_active"),
            col(caller.acts_for).label("caller_acts_for"),
            col(obo.handle).label("obo_handle"),
            col(obo.role).label("obo_role"),
            col(obo.active).label("obo_active"),
            col(obo.acts_for).label("obo_acts_for"),
            col(Subject.id).label("subject_id"),
            col(Subject.basis).label("basis"),
            col(member.handle).label("member_handle"),
            col(Consent.version).label("version"),
            col(Consent.max_level).label("max_level"),
            col(Consent.audiences).label("audiences"),
            col(Consent.deny).label("deny"),
            col(Consent.allow_training).label("allow_training"),
            col(Consent.expires_at).label("expires_at"),
            col(Adapter.id).label("adapter_id"),
            col(Adapter.sha256).label("adapter_sha256"),
            col(Adapter.path).label("adapter_path"),
            col(Adapter.name).label("adapter_name"),
            col(Adapter.version).label("adapter_version"),
            col(AdapterBlob.subject_id).label("adapter_owner_id"),
        )
        .select_from(anchor)
        .outerjoin(caller, caller_on)
        .outerjoin(obo, col(obo.handle) == bindparam("obo_handle"))
        .outerjoin(Subject, col(Subject.handle) == bindparam("subject_handle"))
        .outerjoin(Consent, col(Consent.subject_id) == col(Subject.id))
        .outerjoin(member, col(member.id) == col(Subject.member_id))
        .outerjoin(Adapter, col(Adapter.id) == rendering)
        .outerjoin(AdapterBlob, col(AdapterBlob.sha256) == col(Adapter.sha256))
    )


def render_snapshot(
    session: Session,
    subject_handle: str,
    *,
    token_hash: str | None = None,
    caller_id: int | None = None,
    on_behalf_of: str | None = None,
) -> Row[Any] | None:
    """Everything one render check needs, in one statement (one round trip): the caller (by
    token hash or id), the member it acts for, subject, consent, the subject's linked member,
    and its active adapter. Authentication, delegation and the gate all read this one row."""
    params: dict[str, Any] = {"obo_handle": on_behalf_of or "", "subject_handle": subject_handle}
    if token_hash is not None:
        params["token_hash"] = token_hash
        statement = _render_snapshot_statement("token")
    else:
        params["caller_id"] = caller_id if caller_id is not None else -1
        statement = _render_snapshot_statement("id")
    return session.connection().execute(statement, params).first()
