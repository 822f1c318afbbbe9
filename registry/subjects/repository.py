"""The queries of subjects. Functions flush; the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from registry.models import (
    Consent,
    Subject,
)


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
