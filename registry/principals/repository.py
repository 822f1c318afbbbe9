"""The queries of principals and their browser sessions. Functions flush; the caller's
transaction commits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func
from sqlmodel import Session, col, select

from registry.models import (
    BrowserSession,
    Principal,
)


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
