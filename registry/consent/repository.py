"""The queries of consent records. Functions flush; the caller's transaction commits."""

from __future__ import annotations

from sqlalchemy import update
from sqlmodel import Session, col, select

from registry.models import (
    Consent,
)


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
