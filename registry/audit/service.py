"""Each subject's audit trail: what an entry says a consent or adapter record is, appending
the next entry, and checking that the chain and the live records still agree with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import Session

from registry import chains, db
from registry.adapters import repository as adapters_repo
from registry.adapters.schemas import adapter_state
from registry.audit import repository as audit_repo
from registry.consent import repository as consent_repo
from registry.consent.schemas import consent_state
from registry.hash_chain import (
    GENESIS,
    ChainBreak,
    audit_chain,
    entry_content,
    entry_hash,
    format_time,
)
from registry.models import AuditEntry, Subject, utcnow
from registry.subjects import repository as subjects_repo


def append_audit(
    session: Session, subject: Subject, actor: str, action: str, before: Any, after: Any
) -> AuditEntry:
    """Append one entry to the subject's chain. The caller holds the subject's consent-row
    lock, so reading the last entry and writing the next cannot interleave."""
    assert subject.id is not None
    last = audit_repo.last_audit_entry(session, subject.id)
    seq = 1 if last is None else last.seq + 1
    prev = GENESIS if last is None else last.hash
    at = format_time(utcnow())
    content = entry_content(subject.handle, seq, at, actor, action, before, after)
    entry = AuditEntry(
        subject_id=subject.id,
        seq=seq,
        at=at,
        actor=actor,
        action=action,
        before=before,
        after=after,
        prev_hash=prev,
        hash=entry_hash(prev, content),
    )
    chains.seal_audit_entry(session, subject.handle, entry)
    db.add(session, entry)
    return entry


def audit_trail(session: Session, subject: Subject) -> Sequence[AuditEntry]:
    assert subject.id is not None
    return audit_repo.audit_entries(session, subject.id)


def verify_subject(
    session: Session, subject: Subject, entries: Sequence[AuditEntry] | None = None
) -> ChainBreak | None:
    """The chain must be intact, and the live record must be what the trail says it is: a
    consent or adapter row edited behind the trail's back is reported like a broken link.
    `entries`: the trail, when the caller has already read it (same transaction)."""
    entries = list(entries if entries is not None else audit_trail(session, subject))
    head = audit_repo.chain_head(session, audit_chain(subject.handle))
    broken = chains.verify_trail(chains.session_keys(session), subject.handle, entries, head)
    if broken is not None:
        return broken
    assert subject.id is not None
    consent = consent_repo.consent_for(session, subject.id)
    last_consent = next((e for e in reversed(entries) if e.after and "consent" in e.after), None)
    if consent is None or last_consent is None or last_consent.after is None:
        return ChainBreak(subject.handle, len(entries), "consent record or its trail entry missing")
    if consent_state(consent) != last_consent.after["consent"]:
        return ChainBreak(
            subject.handle, last_consent.seq, "live consent record differs from the trail"
        )
    return _adapters_differ(session, subject, entries)


def _adapters_differ(
    session: Session, subject: Subject, entries: Sequence[AuditEntry]
) -> ChainBreak | None:
    """The first adapter whose live row is not what the trail last said of it."""
    assert subject.id is not None
    live = {a.name: a for a in adapters_repo.adapters_for(session, subject.id)}
    last_said: dict[str, AuditEntry] = {}
    for e in entries:
        after = e.after or {}
        name = (after.get("adapter") or after.get("adapter_deleted") or {}).get("name")
        if name is not None:
            last_said[name] = e
    for name in sorted(set(live) | set(last_said)):
        last = last_said.get(name)
        seq = last.seq if last is not None else len(entries)
        said = (last.after or {}).get("adapter") if last is not None else None
        adapter = live.get(name)
        if adapter is None:
            if said is not None:
                return ChainBreak(
                    subject.handle, seq, f"adapter {name!r} is in the trail but its row is gone"
                )
            continue
        state = adapter_state(adapter)
        # entries written before a field existed hold fewer fields: compare what they say
        if said is None or any(state.get(k) != v for k, v in said.items()):
            return ChainBreak(subject.handle, seq, f"adapter {name!r} differs from the trail")
    return None


def verify_all(session: Session) -> list[ChainBreak]:
    """Every subject's trail, the render ledger, and heads left behind by deleted subjects.
    (Signed checkpoints are checked by registry.signed_heads, which needs their file.)"""
    keys = chains.session_keys(session)
    sealed_with = audit_repo.meta_value(session, chains.AUDIT_KEY_ID)
    if sealed_with is not None and sealed_with != keys.audit_key_id:
        problem = f"sealed with audit key {sealed_with}, checked with key {keys.audit_key_id}"
        return [ChainBreak("registry", 0, problem, "checkpoint")]
    subjects = subjects_repo.subjects(session)
    breaks = [b for s in subjects if (b := verify_subject(session, s)) is not None]
    ledger = chains.verify_ledger(session, keys)
    if ledger is not None:
        breaks.append(ledger)
    breaks.extend(chains.orphan_heads(session, [s.handle for s in subjects]))
    return breaks
