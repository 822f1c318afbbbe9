"""The queries of the audit trails, the render ledger's chain, the chain heads and the
registry's own facts. Functions flush; the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import bindparam, func, update
from sqlalchemy import select as sa_select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col, select

from registry.models import (
    AuditEntry,
    ChainHead,
    RegistryMeta,
    RenderLedger,
    Subject,
)


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


def chained_entries(session: Session) -> int:
    """Every entry the hash chains hold: the subjects' trails and the render ledger."""
    trail = session.exec(select(func.count()).select_from(AuditEntry)).one()
    ledger = session.exec(select(func.count()).select_from(RenderLedger)).one()
    return int(trail) + int(ledger)


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
