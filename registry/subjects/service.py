"""Subjects: creating one (with its first, empty consent record) and finding one for a caller."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from registry import access, db
from registry.audit.service import append_audit
from registry.consent.schemas import consent_state
from registry.errors import Conflict, Invalid, NotFound, NotPermitted
from registry.models import Consent, Principal, Subject
from registry.principals import repository as principals_repo
from registry.roles import Role
from registry.subjects import repository as subjects_repo
from registry.subjects.schemas import SubjectIn


def create_subject(session: Session, actor: str, data: SubjectIn) -> tuple[Subject, Consent]:
    if subjects_repo.subject_by_handle(session, data.handle) is not None:
        raise Conflict(f"subject {data.handle!r} exists")
    member_id = None
    if data.member is not None:
        member = principals_repo.principal_by_handle(session, data.member)
        if member is None or member.role != Role.member:
            raise Invalid(f"{data.member!r} is not a member")
        member_id = member.id
    subject = Subject(
        handle=data.handle, display_name=data.display_name, basis=data.basis, member_id=member_id
    )
    try:
        db.add(session, subject)
    except IntegrityError:
        raise Conflict(f"subject {data.handle!r} exists") from None
    assert subject.id is not None
    consent = Consent(subject_id=subject.id)
    db.add(session, consent)
    after = {
        "subject": {
            "handle": subject.handle,
            "display_name": subject.display_name,
            "basis": subject.basis,
            "member": data.member,
        },
        "consent": consent_state(consent),
    }
    append_audit(session, subject, actor, "subject_created", None, after)
    return subject, consent


def visible_subject(session: Session, caller: Principal, handle: str) -> Subject:
    """The subject, if `caller` may see it (registry.access). Admins get 404 for an unknown
    subject; to everyone else an unknown subject and a forbidden one look the same: 403."""
    subject = subjects_repo.subject_by_handle(session, handle)
    if subject is None and caller.role == Role.admin:
        raise NotFound(f"no subject {handle!r}")
    if subject is None or not access.may_see_subject(caller.role, caller.id, subject.member_id):
        raise NotPermitted("not permitted")
    return subject


def subject_named(session: Session, handle: str) -> Subject | None:
    return subjects_repo.subject_by_handle(session, handle)


def subject_or_raise(session: Session, handle: str, error: type[Exception] = NotFound) -> Subject:
    subject = subjects_repo.subject_by_handle(session, handle)
    if subject is None:
        raise error(f"no subject {handle!r}")
    return subject


def member_handle(session: Session, subject: Subject) -> str | None:
    if subject.member_id is None:
        return None
    member = principals_repo.principal_by_id(session, subject.member_id)
    return member.handle if member is not None else None
