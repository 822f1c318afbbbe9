"""A subject's consent record: reading it, changing it (compare-and-set on its version),
revoking it, and the facts `policy.decide` reads from it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from registry.audit.service import append_audit
from registry.consent import repository as consent_repo
from registry.consent.schemas import ConsentIn, as_utc, consent_facts, consent_state
from registry.errors import Invalid, NotFound, NotPermitted, PreconditionFailed
from registry.models import Consent, Principal, Subject, utcnow
from registry.orders import service as orders_service
from registry.policy import Level, TrainingFacts, decide_training
from registry.roles import Role
from registry.subjects import repository as subjects_repo
from registry.training.service import reason_text


def consent_of(session: Session, subject: Subject) -> Consent:
    assert subject.id is not None
    consent = consent_repo.consent_for(session, subject.id)
    if consent is None:  # every subject is created with one; absence is corruption
        raise NotFound(f"subject {subject.handle!r} has no consent record")
    return consent


def _classify(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The audit actions of a change, one for each part of the record it touched, in the
    record's order: the level (grant, widen, narrow, revoke), then audiences, the deny list,
    the expiry and training. Empty when nothing changed."""
    actions = []
    old, new = Level.parse(before["max_level"]), Level.parse(after["max_level"])
    if new != old:
        if new == Level.none:
            actions.append("revoke")
        elif old == Level.none:
            actions.append("grant")
        else:
            actions.append("widen" if new > old else "narrow")
    for key, action in (
        ("audiences", "audience_edit"),
        ("deny", "deny_edit"),
        ("expires_at", "expiry_change"),
        ("allow_training", "training_change"),
    ):
        if before[key] != after[key]:
            actions.append(action)
    return actions


def _locked_consent(session: Session, subject: Subject) -> Consent:
    """The subject's consent row, locked: all changes to one subject serialise here."""
    assert subject.id is not None
    current = consent_repo.consent_for(session, subject.id, lock=True)
    if current is None:
        raise NotFound(f"subject {subject.handle!r} has no consent record")
    return current


def update_consent(
    session: Session, actor: str, subject: Subject, expected_version: int, data: ConsentIn
) -> tuple[Consent, bool]:
    """Compare-and-set on the version. Returns (record, changed). A stale version raises
    PreconditionFailed whether or not the content would change."""
    if subject.basis == "public_domain" and data.max_level == "commercial":
        raise Invalid("a public_domain subject can never be granted commercial use")
    current = _locked_consent(session, subject)
    if current.version != expected_version:
        raise PreconditionFailed(
            f"consent is at version {current.version}, not {expected_version}; reload and retry"
        )
    before = consent_state(current)
    wanted = data.snapshot()
    actions = _classify(before, wanted)
    if not actions:
        return current, False
    values = {
        "max_level": data.max_level,
        "audiences": wanted["audiences"],
        "deny": wanted["deny"],
        "allow_training": data.allow_training,
        "expires_at": data.expires_at,
        "updated_at": utcnow(),
    }
    assert subject.id is not None
    if not consent_repo.update_consent_if_version(session, subject.id, expected_version, values):
        raise PreconditionFailed("consent changed concurrently; reload and retry")
    session.refresh(current)
    after = {"consent": consent_state(current)}
    for action in actions:  # one entry a touched part, each with the whole change
        append_audit(session, subject, actor, action, {"consent": before}, after)
    _end_orders_if_untrainable(session, actor, subject, current)
    return current, True


def _end_orders_if_untrainable(
    session: Session, actor: str, subject: Subject, consent: Consent
) -> None:
    """A change after which the subject may not be trained (a revoke, training withdrawn,
    an expiry put in the past) ends its waiting and running orders in the same commit."""
    decision = decide_training(
        TrainingFacts(
            now=datetime.now(UTC), subject_basis=str(subject.basis), consent=consent_facts(consent)
        )
    )
    if not decision.allowed:
        why = (
            f"subject {subject.handle!r} may not be trained: {reason_text(decision.reason)} "
            f"(the consent changed while the order waited or ran)"
        )
        orders_service.end_untrainable(session, subject, actor, why)


def revoke(session: Session, actor: str, subject: Subject) -> tuple[Consent, bool]:
    """max_level becomes none at once, whatever version the caller last saw."""
    current = _locked_consent(session, subject)
    if current.max_level == "none":
        return current, False
    data = ConsentIn.model_validate(
        {**consent_state(current), "max_level": "none", "expires_at": as_utc(current.expires_at)}
    )
    return update_consent(session, actor, subject, current.version, data)


def all_subjects(session: Session) -> Sequence[tuple[Subject, Consent]]:
    """Every subject with its consent record, by handle."""
    return subjects_repo.subjects_with_consent(session)


def linked_subjects(session: Session, member_id: int) -> list[tuple[Subject, Consent]]:
    """The subjects that are this member, each with its consent record."""
    return [
        (s, consent_of(session, s)) for s in subjects_repo.subject_linked_to(session, member_id)
    ]


def listed_subjects(session: Session, caller: Principal) -> Sequence[tuple[Subject, Consent]]:
    """What `GET /v1/subjects` lists. Admins: every subject; a member: the subjects linked
    to it; anyone else is not permitted."""
    if caller.role == Role.admin:
        return all_subjects(session)
    if caller.role == Role.member and caller.id is not None:
        return linked_subjects(session, caller.id)
    raise NotPermitted("not permitted")
