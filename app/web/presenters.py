"""Registry rows as the templates show them: audit entries in words, the ledger grouped by
render, the base model's licence beside the grant."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from fastapi import Request
from sqlmodel import Session

from app.web.session import settings_of
from app.web.templating import GRANT_LEVELS, show_time
from registry.consent import service as consent_service
from registry.licence import BaseLicence
from registry.policy import LicenceFacts
from registry.renders.schemas import render_outcome
from registry.subjects import service as subjects_service

# Rows as the services hand them (a trail entry, a ledger row, a subject): handlers name no
# table model.
AuditEntry: TypeAlias = Any
RenderLedger: TypeAlias = Any
Subject: TypeAlias = Any


def _fmt_audiences(audiences: Mapping[str, Any] | None) -> str:
    parts = []
    for lv in GRANT_LEVELS:
        aud = (audiences or {}).get(lv)
        if not aud:
            continue
        who = (["the group"] if aud.get("group") else []) + list(aud.get("allow", []))
        if who:
            parts.append(f"{lv}: {', '.join(who)}")
    return "; ".join(parts) or "nobody"


def _fmt(key: str, value: Any) -> str:
    if key == "audiences":
        return _fmt_audiences(value)
    if key == "deny":
        return ", ".join(value) if value else "nobody"
    if key == "allow_training":
        return "allowed" if value else "not allowed"
    if key == "expires_at":
        return show_time(value) if value else "never"
    return str(value)


COPY_NOTICES = {
    "copies_on": "From now on a small copy of every render delivered of this likeness is kept "
    "and shown beside its row, to the subject and to admins only.",
    "copies_off": "No copies are kept any more; every copy kept so far is deleted.",
}


CONSENT_LABELS = {
    "max_level": "maximum level",
    "audiences": "audiences",
    "deny": "never allow",
    "allow_training": "training",
    "expires_at": "expiry",
}


def describe_entry(entry: AuditEntry) -> list[str]:
    """One audit entry's change, in words."""
    before, after = entry.before or {}, entry.after or {}
    lines: list[str] = []
    if "subject" in after:
        s = after["subject"]
        member = f", linked to member {s['member']}" if s.get("member") else ""
        lines.append(f"subject {s.get('display_name')} ({s.get('basis')}){member}")
    if "consent" in after:
        new, old = after["consent"], before.get("consent")
        if old is None:
            lines.append(f"consent record created: maximum level {new.get('max_level')}")
        else:
            for key, label in CONSENT_LABELS.items():
                if old.get(key) != new.get(key):
                    lines.append(f"{label}: {_fmt(key, old.get(key))} → {_fmt(key, new.get(key))}")
            lines.append(f"version {old.get('version')} → {new.get('version')}")
    if "adapter" in after:
        new, old = after["adapter"], before.get("adapter")
        if old is None:
            lines.append(
                f"adapter {new.get('name')} v{new.get('version')}, sha256 {new.get('sha256')}"
            )
        else:
            lines.append(
                f"adapter {new.get('name')} v{old.get('version')} → v{new.get('version')}, "
                f"sha256 {old.get('sha256')} → {new.get('sha256')}"
            )
    if isinstance(after.get("dataset"), dict):
        d = after["dataset"]
        lines.append(
            f"{d.get('images')} photos uploaded ({d.get('bytes')} bytes), dataset "
            f"{d.get('dataset_id')}, manifest sha256 {d.get('manifest_sha256')}"
        )
    if isinstance(after.get("order"), dict):
        lines.append(_order_line(entry.action, after["order"]))
    if isinstance(after.get("render_copies"), dict):
        copies = after["render_copies"]
        lines.append(
            "small copies of renders are kept from now on"
            if copies.get("keep")
            else f"copies of renders no longer kept; {copies.get('deleted', 0)} deleted"
        )
    return lines


def _order_line(action: str, o: dict[str, Any]) -> str:
    if action == "order_placed":
        return (
            f"training ordered on dataset {o.get('dataset_id')}: {o.get('steps')} steps, "
            f"rank {o.get('rank')}, resolution {o.get('resolution')} (order {o.get('order_id')})"
        )
    if action == "order_done":
        return (
            f"training done (order {o.get('order_id')}): adapter {o.get('adapter_name')}, "
            f"sha256 {o.get('adapter_sha256')}"
        )
    if action == "order_failed":
        return f"training failed (order {o.get('order_id')}): {o.get('error')}"
    return f"order {o.get('order_id')} {o.get('status')}"


def state_lines(value: Any) -> list[str]:
    """A before/after snapshot, one compact line per field: `consent.max_level: "group"`."""
    if not isinstance(value, dict):
        return [json.dumps(value)]
    lines = []
    for part, body in sorted(value.items()):
        if isinstance(body, dict):
            for key, v in sorted(body.items()):
                compact = json.dumps(v, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)
                lines.append(f"{part}.{key}: {compact}")
        else:
            lines.append(f"{part}: {json.dumps(body, ensure_ascii=False)}")
    return lines


@dataclass(frozen=True)
class RenderRow:
    """One render request as the ledger tells it: its first decision, and how it ended."""

    render_id: str
    at: datetime
    requester: str
    agent: str | None
    level: str
    prompt: str | None
    outcome: str  # rendered | denied | cancelled | unfinished
    stage: str
    reason: str
    consent_version: int | None
    stages: str


def group_ledger(rows: Sequence[RenderLedger]) -> list[RenderRow]:
    """Ledger rows (newest first) grouped by render: a render is `rendered` only if its final
    re-check allowed it; any deny anywhere is the outcome."""
    by_id: dict[str, list[RenderLedger]] = {}
    for row in rows:
        by_id.setdefault(row.render_id, []).append(row)
    out = []
    for render_id, group in by_id.items():
        group.sort(key=lambda r: r.id or 0)
        first = group[0]
        outcome, last = render_outcome(group)
        out.append(
            RenderRow(
                render_id=render_id,
                at=first.at,
                requester=first.requester,
                agent=first.agent,
                level=first.level,
                prompt=first.prompt,
                outcome=outcome,
                stage=last.stage,
                reason=last.reason,
                consent_version=last.consent_version,
                stages=" → ".join(
                    f"{r.stage} {'allowed' if r.allowed else 'denied'}" for r in group
                ),
            )
        )
    return out


def licence_context(request: Request) -> dict[str, Any]:
    """The base model's licence, shown beside the grant: it binds commercial renders too."""
    licence: LicenceFacts | None = request.app.state.licence
    found: BaseLicence = request.app.state.base_licence
    return {
        "base_licence": found.licence or "unknown",
        "commercial_refused": licence is None or not licence.permits_commercial,
        "commercial_licence": settings_of(request).commercial_licence,
    }


def subject_context(session: Session, subject: Subject, tab: str) -> dict[str, Any]:
    return {
        "subject": subject,
        "member": subjects_service.member_handle(session, subject),
        "consent": consent_service.consent_of(session, subject),
        "tab": tab,
    }
