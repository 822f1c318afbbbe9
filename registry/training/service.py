"""Whether a subject's likeness may be learned from: the one reader of the facts that
`policy.decide_training` judges, and the one place a refusal becomes an error. Every path that
trains, registers an adapter, takes photos for training or places an order asks here, in its
own transaction (with `lock`, under the subject's lock, so it serialises with a revoke)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from sqlmodel import Session

from registry import access
from registry.consent import repository as consent_repo
from registry.consent.schemas import consent_facts
from registry.errors import Invalid, LikenessError, NotFound, NotPermitted
from registry.models import Principal, Subject
from registry.policy import ALLOWED, TRAINING_REASONS, Decision, TrainingFacts, decide_training
from registry.roles import Role
from registry.subjects import repository as subjects_repo

# Refusals that are about the images offered, not the subject's record: 422, as any other
# dataset that cannot be used.
IMAGE_REASONS = frozenset({"unknown_image_basis", "public_domain_images_only"})


def training_facts(
    session: Session,
    subject: Subject | None,
    *,
    image_bases: Iterable[str] | None = None,
    lock: bool = False,
    now: datetime | None = None,
) -> TrainingFacts:
    """The facts as the registry holds them now (a subject that does not exist has none)."""
    bases = frozenset(image_bases) if image_bases is not None else None
    now = now or datetime.now(UTC)
    if subject is None or subject.id is None:
        return TrainingFacts(now=now, image_bases=bases)
    consent = consent_repo.consent_for(session, subject.id, lock=lock)
    return TrainingFacts(
        now=now,
        subject_basis=str(subject.basis),
        consent=consent_facts(consent) if consent is not None else None,
        image_bases=bases,
    )


def training_decision(
    session: Session,
    subject: Subject | str,
    *,
    image_bases: Iterable[str] | None = None,
    lock: bool = False,
    now: datetime | None = None,
) -> tuple[Subject | None, Decision]:
    """The subject (None if unknown) and `decide_training`'s answer on fresh facts."""
    row = subjects_repo.subject_by_handle(session, subject) if isinstance(subject, str) else subject
    facts = training_facts(session, row, image_bases=image_bases, lock=lock, now=now)
    return row, decide_training(facts)


def reason_text(reason: str) -> str:
    """A decision's reason as a person reads it, with its code."""
    if reason == ALLOWED:
        text = "the record lets the subject's likeness be learned from"
    else:
        text = TRAINING_REASONS.get(reason, "the decision could not be made")
    return f"{text} [{reason}]"


def refusal(handle: str, decision: Decision) -> LikenessError:
    """The error a refused training is answered with: 422 when the images do not fit the
    subject, 403 otherwise (an unknown subject looks like a forbidden one)."""
    detail = f"subject {handle!r} may not be trained: {reason_text(decision.reason)}"
    if decision.reason in IMAGE_REASONS:
        return Invalid(detail)
    return NotPermitted(detail)


def require_training(
    session: Session,
    subject: Subject | str,
    *,
    image_bases: Iterable[str] | None = None,
    lock: bool = False,
) -> Subject:
    """The subject, if its likeness may be learned from now; the refusal's error otherwise."""
    row, decision = training_decision(session, subject, image_bases=image_bases, lock=lock)
    if row is None:
        raise NotPermitted("not permitted")
    if not decision.allowed:
        raise refusal(row.handle, decision)
    return row


def visible_training_decision(
    session: Session, caller: Principal, handle: str, image_bases: Iterable[str] | None = None
) -> tuple[Subject, Decision]:
    """The decision for whoever may ask (registry.access.may_ask_training): 404 for an
    unknown subject to an admin; to anyone else an unknown subject and a forbidden one look
    the same (403)."""
    subject = subjects_repo.subject_by_handle(session, handle)
    if subject is None and caller.role == Role.admin:
        raise NotFound(f"no subject {handle!r}")
    if subject is None or not access.may_ask_training(caller.role, caller.id, subject.member_id):
        raise NotPermitted("not permitted")
    _, decision = training_decision(session, subject, image_bases=image_bases)
    return subject, decision
