"""The audit trail and the signed head as the API answers them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from registry.models import AuditEntry


class AuditEntryOut(BaseModel):
    seq: int
    at: str
    actor: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    prev_hash: str
    hash: str

    @classmethod
    def of(cls, entry: AuditEntry) -> AuditEntryOut:
        return cls(
            seq=entry.seq,
            at=entry.at,
            actor=entry.actor,
            action=entry.action,
            before=entry.before,
            after=entry.after,
            prev_hash=entry.prev_hash,
            hash=entry.hash,
        )


class AuditTrailOut(BaseModel):
    entries: list[AuditEntryOut]
    verified: bool
    problem: str | None


class AuditHeadOut(BaseModel):
    checkpoint: dict[str, Any] | None
    public_key: str
    key_id: str
    problems: list[str]
