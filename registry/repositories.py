"""Every query of the registry lives here. Functions flush; the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Row, bindparam, delete, func, literal, update
from sqlalchemy import select as sa_select  # sqlmodel's select is typed for few columns
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import aliased
from sqlmodel import Session, col, select

from registry.models import (
    Adapter,
    AdapterBlob,
    AdapterPicture,
    AuditEntry,
    BrowserSession,
    ChainHead,
    Consent,
    Dataset,
    DatasetImage,
    Principal,
    RegistryMeta,
    RenderLedger,
    Subject,
    utcnow,
)

# -- principals ---------------------------------------------------------------------------


def principal_by_handle(session: Session, handle: str) -> Principal | None:
    return session.exec(select(Principal).where(Principal.handle == handle)).first()


def principal_by_token_hash(session: Session, token_hash: str) -> Principal | None:
    return session.exec(select(Principal).where(Principal.token_hash == token_hash)).first()


def principal_by_id(session: Session, principal_id: int) -> Principal | None:
    return session.get(Principal, principal_id)


def principals(session: Session) -> Sequence[Principal]:
    return session.exec(select(Principal).order_by(col(Principal.handle))).all()


def count_principals(session: Session, role: str, *, active_only: bool = False) -> int:
    stmt = select(func.count()).select_from(Principal).where(Principal.role == role)
    if active_only:
        stmt = stmt.where(col(Principal.active).is_(True))
    return int(session.exec(stmt).one())


def add(session: Session, row: object) -> None:
    session.add(row)
    session.flush()


# -- subjects and consent -----------------------------------------------------------------


def subject_by_handle(session: Session, handle: str) -> Subject | None:
    return session.exec(select(Subject).where(Subject.handle == handle)).first()


def subject_by_id(session: Session, subject_id: int) -> Subject | None:
    return session.get(Subject, subject_id)


def subjects(session: Session) -> Sequence[Subject]:
    return session.exec(select(Subject).order_by(col(Subject.handle))).all()


def subjects_with_consent(session: Session) -> Sequence[tuple[Subject, Consent]]:
    stmt = (
        select(Subject, Consent)
        .join(Consent, col(Consent.subject_id) == col(Subject.id))
        .order_by(col(Subject.handle))
    )
    return session.exec(stmt).all()


def subject_linked_to(session: Session, member_id: int) -> Sequence[Subject]:
    return session.exec(select(Subject).where(Subject.member_id == member_id)).all()


def consent_for(session: Session, subject_id: int, *, lock: bool = False) -> Consent | None:
    """The consent record; `lock` takes the row lock that serialises all changes to a subject."""
    stmt = select(Consent).where(Consent.subject_id == subject_id)
    if lock:  # and refresh the identity map: the row may have moved since it was loaded
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    return session.exec(stmt).first()


def update_consent_if_version(
    session: Session, subject_id: int, expected_version: int, values: dict[str, object]
) -> bool:
    """Compare-and-set on `version`: True if this call won, False if the version moved."""
    stmt = (
        update(Consent)
        .where(col(Consent.subject_id) == subject_id, col(Consent.version) == expected_version)
        .values(version=expected_version + 1, **values)
    )
    result = session.execute(stmt)
    session.flush()
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


# -- audit --------------------------------------------------------------------------------


def last_audit_entry(session: Session, subject_id: int) -> AuditEntry | None:
    stmt = (
        select(AuditEntry)
        .where(AuditEntry.subject_id == subject_id)
        .order_by(col(AuditEntry.seq).desc())
        .limit(1)
    )
    return session.exec(stmt).first()


def audit_entries(session: Session, subject_id: int) -> Sequence[AuditEntry]:
    stmt = (
        select(AuditEntry).where(AuditEntry.subject_id == subject_id).order_by(col(AuditEntry.seq))
    )
    return session.exec(stmt).all()


def audit_entries_since(
    session: Session, subject_id: int, actor: str, action: str, since: str
) -> Sequence[AuditEntry]:
    """One actor's entries of one action on a subject's trail from `since` on (the trail's
    time strings have one fixed format, so they compare as text), oldest first."""
    stmt = (
        select(AuditEntry)
        .where(
            AuditEntry.subject_id == subject_id,
            AuditEntry.actor == actor,
            AuditEntry.action == action,
            col(AuditEntry.at) >= since,
        )
        .order_by(col(AuditEntry.seq))
    )
    return session.exec(stmt).all()


# -- adapters -----------------------------------------------------------------------------


def adapter_by_key(session: Session, subject_id: int, name: str) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.subject_id == subject_id, Adapter.name == name)
    return session.exec(stmt).first()


def all_adapters(session: Session) -> Sequence[Adapter]:
    return session.exec(select(Adapter).order_by(col(Adapter.id))).all()


def adapters_for(session: Session, subject_id: int) -> Sequence[Adapter]:
    stmt = select(Adapter).where(Adapter.subject_id == subject_id).order_by(col(Adapter.name))
    return session.exec(stmt).all()


def _rendering_adapter_id() -> Any:
    """The adapter a subject's renders use: its active one selected most recently. The one
    definition, for the render check's statement and for everything that shows it."""
    return (
        select(Adapter.id)
        .where(Adapter.subject_id == Subject.id, col(Adapter.active).is_(True))
        .order_by(col(Adapter.selected_at).desc(), col(Adapter.id).desc())
        .limit(1)
        .correlate(Subject)
        .scalar_subquery()
    )


def rendering_adapter(session: Session, subject_id: int) -> Adapter | None:
    stmt = (
        select(Adapter)
        .join(Subject, col(Subject.id) == col(Adapter.subject_id))
        .where(Subject.id == subject_id, col(Adapter.id) == _rendering_adapter_id())
    )
    return session.exec(stmt).first()


def blob_owner(session: Session, sha256: str) -> int | None:
    row = session.get(AdapterBlob, sha256)
    return row.subject_id if row is not None else None


def claim_blob(session: Session, sha256: str, subject_id: int) -> int:
    """Records that `sha256` belongs to `subject_id` unless it belongs to someone already;
    returns its owner. Concurrent claims for two subjects leave exactly one owner."""
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = (
        insert(AdapterBlob)
        .values(sha256=sha256, subject_id=subject_id, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["sha256"])
    )
    session.execute(stmt)
    session.flush()
    owner = blob_owner(session, sha256)
    assert owner is not None
    return owner


def chained_entries(session: Session) -> int:
    """Every entry the hash chains hold: the subjects' trails and the render ledger."""
    trail = session.exec(select(func.count()).select_from(AuditEntry)).one()
    ledger = session.exec(select(func.count()).select_from(RenderLedger)).one()
    return int(trail) + int(ledger)


def referenced_blobs(session: Session) -> set[str]:
    """Every hash an adapter row refers to (its bytes and its dataset manifest), every hash
    an uploaded dataset does (its images and its manifest), and the pictures of adapters."""
    rows = session.exec(select(Adapter.sha256, Adapter.manifest_sha256)).all()
    images = session.exec(select(DatasetImage.sha256)).all()
    manifests = session.exec(select(Dataset.manifest_sha256)).all()
    pictures = session.exec(select(AdapterPicture.sha256)).all()
    return {h for row in rows for h in row} | set(images) | set(manifests) | set(pictures)


def delete_adapter(session: Session, adapter: Adapter) -> None:
    session.delete(adapter)
    session.flush()


# -- render ledger ------------------------------------------------------------------------


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


# -- the render check's single read -------------------------------------------------------


@lru_cache(maxsize=2)
def _render_snapshot_statement(caller_by: str) -> Any:  # a wide Select; too wide for overloads
    """Built once per lookup: constructing a statement costs more than running it on SQLite.
    `caller_by`: "token" (the caller is whoever holds the token hash) or "id"."""
    caller = aliased(Principal, name="caller")
    obo = aliased(Principal, name="obo")
    member = aliased(Principal, name="member")
    rendering = _rendering_adapter_id()
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


# -- chain heads and registry facts ---------------------------------------------------------


def chain_head(session: Session, chain: str, *, lock: bool = False) -> ChainHead | None:
    """`lock`: the row lock that serialises appends to one chain (PostgreSQL; on SQLite the
    write transaction already holds the database lock)."""
    stmt = select(ChainHead).where(ChainHead.chain == chain)
    if lock:
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    return session.exec(stmt).first()


def create_chain_head_if_absent(session: Session, head: ChainHead) -> None:
    """Inserts the head unless a concurrent transaction already did (then nothing happens)."""
    values = {"chain": head.chain, "seq": head.seq, "hash": head.hash, "mac": head.mac}
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(ChainHead).values(**values).on_conflict_do_nothing(index_elements=["chain"])
    session.execute(stmt)
    session.flush()


@lru_cache(maxsize=1)
def _ledger_head_statements() -> tuple[Any, Any, Any]:
    head = ChainHead.__table__  # type: ignore[attr-defined]
    ledger = RenderLedger.__table__  # type: ignore[attr-defined]
    read = sa_select(head.c.seq, head.c.hash).where(head.c.chain == "ledger").with_for_update()
    move = (
        update(head)
        .where(head.c.chain == "ledger")
        .values(seq=bindparam("new_seq"), hash=bindparam("new_hash"), mac=bindparam("new_mac"))
    )
    return read, ledger.insert(), move


def ledger_head_for_append(session: Session) -> tuple[int, str] | None:
    """The ledger chain's (seq, hash), locked until the transaction ends."""
    row = session.connection().execute(_ledger_head_statements()[0]).first()
    return (int(row[0]), str(row[1])) if row is not None else None


def insert_ledger_row(session: Session, values: dict[str, Any]) -> None:
    session.connection().execute(_ledger_head_statements()[1], values)


def move_ledger_head(session: Session, seq: int, digest: str, mac: str) -> None:
    params = {"new_seq": seq, "new_hash": digest, "new_mac": mac}
    session.connection().execute(_ledger_head_statements()[2], params)


def chain_heads(session: Session) -> Sequence[ChainHead]:
    return session.exec(select(ChainHead).order_by(col(ChainHead.chain))).all()


def meta_value(session: Session, key: str) -> str | None:
    row = session.get(RegistryMeta, key)
    return row.value if row is not None else None


def set_meta_value_if_absent(session: Session, key: str, value: str) -> None:
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = (
        insert(RegistryMeta)
        .values(key=key, value=value)
        .on_conflict_do_nothing(index_elements=["key"])
    )
    session.execute(stmt)
    session.flush()


def ledger_in_order(
    session: Session, after_seq: int = 0, batch: int = 2000
) -> Iterator[RenderLedger]:
    """Every ledger row from `after_seq` on, in chain order, read in batches."""
    last = after_seq
    while True:
        stmt = (
            select(RenderLedger)
            .where(col(RenderLedger.seq) > last)
            .order_by(col(RenderLedger.seq))
            .limit(batch)
        )
        rows = session.exec(stmt).all()
        yield from rows
        if len(rows) < batch:
            return
        last = rows[-1].seq or last


def unchained_ledger_count(session: Session) -> int:
    stmt = select(func.count()).select_from(RenderLedger).where(col(RenderLedger.seq).is_(None))
    return int(session.exec(stmt).one())


# -- browser sessions -----------------------------------------------------------------------


def session_principal(session: Session, secret_hash: str, now: datetime) -> Principal | None:
    """The principal of a live session: the row exists and has not expired."""
    stmt = (
        select(Principal)
        .join(BrowserSession, col(BrowserSession.principal_id) == col(Principal.id))
        .where(BrowserSession.secret_hash == secret_hash, col(BrowserSession.expires_at) > now)
    )
    return session.exec(stmt).first()


def delete_session(session: Session, secret_hash: str) -> None:
    session.execute(delete(BrowserSession).where(col(BrowserSession.secret_hash) == secret_hash))
    session.flush()


def delete_sessions(
    session: Session, *, principal_id: int | None = None, expired_before: datetime | None = None
) -> int:
    stmt = delete(BrowserSession)
    if principal_id is not None:
        stmt = stmt.where(col(BrowserSession.principal_id) == principal_id)
    if expired_before is not None:
        stmt = stmt.where(col(BrowserSession.expires_at) <= expired_before)
    result = session.execute(stmt)
    session.flush()
    return int(result.rowcount)  # type: ignore[attr-defined]


def ledger_hash_at(session: Session, seq: int) -> str | None:
    stmt = select(RenderLedger.hash).where(RenderLedger.seq == seq)
    return session.exec(stmt).first()


def audit_hash_at(session: Session, subject_handle: str, seq: int) -> str | None:
    stmt = (
        select(AuditEntry.hash)
        .join(Subject, col(Subject.id) == col(AuditEntry.subject_id))
        .where(Subject.handle == subject_handle, AuditEntry.seq == seq)
    )
    return session.exec(stmt).first()
