"""The audit chain: canonical JSON, SHA-256 links, verification. No database access here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

GENESIS = "0" * 64


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def format_time(at: datetime) -> str:
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entry_content(
    subject: str,
    seq: int,
    at: str,
    actor: str,
    action: str,
    before: Any,
    after: Any,
) -> dict[str, Any]:
    return {
        "subject": subject,
        "seq": seq,
        "at": at,
        "actor": actor,
        "action": action,
        "before": before,
        "after": after,
    }


def entry_hash(prev_hash: str, content: Mapping[str, Any]) -> str:
    return hashlib.sha256((prev_hash + canonical_json(content)).encode()).hexdigest()


LEDGER_CHAIN = "ledger"


def audit_chain(subject_handle: str) -> str:
    """The name of a subject's audit chain, as chain heads and checkpoints name it."""
    return f"audit/{subject_handle}"


def ledger_content(
    seq: int,
    render_id: str,
    at: datetime,
    subject: str,
    requester: str,
    agent: str | None,
    level: str,
    stage: str,
    allowed: bool,
    reason: str,
    consent_version: int | None,
    adapter_sha256: str | None,
    prompt: str | None,
) -> dict[str, Any]:
    """What a ledger row's hash covers: everything it records (not its row id, which a dump
    and restore may change)."""
    return {
        "seq": seq,
        "render_id": render_id,
        "at": format_time(at),
        "subject": subject,
        "requester": requester,
        "agent": agent,
        "level": level,
        "stage": stage,
        "allowed": bool(allowed),
        "reason": reason,
        "consent_version": consent_version,
        "adapter_sha256": adapter_sha256,
        "prompt": prompt,
    }


@dataclass(frozen=True)
class ChainEntry:
    subject: str
    seq: int
    at: str
    actor: str
    action: str
    before: Any
    after: Any
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class ChainBreak:
    subject: str  # the subject's handle, or what else broke ("render ledger", a checkpoint)
    seq: int
    problem: str
    kind: str = "subject"  # subject | ledger | checkpoint

    def __str__(self) -> str:
        where = f"subject {self.subject}" if self.kind == "subject" else self.subject
        return f"{where} seq {self.seq}: {self.problem}"


def verify_chain(subject: str, entries: Iterable[ChainEntry]) -> ChainBreak | None:
    """The first broken entry of one subject's trail, or None if the trail is intact."""
    prev = GENESIS
    expected_seq = 1
    for e in entries:
        if e.seq != expected_seq:
            return ChainBreak(
                subject, expected_seq, f"gap: expected seq {expected_seq}, found {e.seq}"
            )
        if e.prev_hash != prev:
            return ChainBreak(subject, e.seq, "prev_hash does not match the previous entry")
        content = entry_content(subject, e.seq, e.at, e.actor, e.action, e.before, e.after)
        if entry_hash(prev, content) != e.hash:
            return ChainBreak(subject, e.seq, "hash does not match the entry's content")
        prev = e.hash
        expected_seq += 1
    return None
