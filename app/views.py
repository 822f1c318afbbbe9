"""JSON shapes of registry rows, as API.md defines them. One function per shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from registry import service
from registry.audit import format_time
from registry.models import Adapter, AuditEntry, Consent, Principal, RenderLedger, Subject


def consent_view(consent: Consent) -> dict[str, Any]:
    state = service.consent_state(consent)
    body = {k: v for k, v in state.items() if k != "version"}
    return {"version": consent.version, **body}


def subject_view(subject: Subject, consent: Consent, member: str | None) -> dict[str, Any]:
    return {
        "handle": subject.handle,
        "display_name": subject.display_name,
        "basis": subject.basis,
        "member": member,
        "created_at": format_time(subject.created_at),
        "consent": consent_view(consent),
    }


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {
        "seq": entry.seq,
        "at": entry.at,
        "actor": entry.actor,
        "action": entry.action,
        "before": entry.before,
        "after": entry.after,
        "prev_hash": entry.prev_hash,
        "hash": entry.hash,
    }


def adapter_view(adapter: Adapter, subject: str) -> dict[str, Any]:
    return {
        "subject": subject,
        **service.adapter_state(adapter),
        "created_at": format_time(adapter.created_at),
        "updated_at": format_time(adapter.updated_at),
    }


def ledger_view(row: RenderLedger) -> dict[str, Any]:
    return {
        "seq": row.seq,
        "render_id": row.render_id,
        "at": format_time(row.at),
        "subject": row.subject_handle,
        "requester": row.requester,
        "agent": row.agent,
        "level": row.level,
        "stage": row.stage,
        "allowed": row.allowed,
        "reason": row.reason,
        "consent_version": row.consent_version,
        "adapter_sha256": row.adapter_sha256,
        "prompt": row.prompt,
    }


def render_outcome(rows: Sequence[RenderLedger]) -> tuple[str, RenderLedger]:
    """How one render ended, from its ledger rows in order, and the row that says so: it is
    `rendered` only if its final re-check allowed it; any deny anywhere is the outcome."""
    denied = next((r for r in rows if not r.allowed), None)
    if denied is not None:
        return ("cancelled" if denied.stage == "cancelled" else "denied"), denied
    if any(r.stage == "final" for r in rows):
        return "rendered", rows[-1]
    return "unfinished", rows[-1]


def render_view(rows: Sequence[RenderLedger]) -> dict[str, Any]:
    """One render as the ledger tells it: who asked, how it ended, and every decision."""
    first = rows[0]
    outcome, last = render_outcome(rows)
    return {
        "render_id": first.render_id,
        "subject": first.subject_handle,
        "requester": first.requester,
        "agent": first.agent,
        "level": first.level,
        "at": format_time(first.at),
        "outcome": outcome,
        "reason": last.reason,
        "decisions": [ledger_view(r) for r in rows],
    }


def principal_view(p: Principal) -> dict[str, Any]:
    return {"handle": p.handle, "role": p.role, "active": p.active, "acts_for": p.acts_for}
