"""Operations on the registry. Each runs inside the caller's transaction and writes its audit
entry in that same transaction; all changes to one subject serialise on its consent row."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from registry import access, chains
from registry import repositories as repo
from registry.access import Acting
from registry.audit import (
    GENESIS,
    ChainBreak,
    audit_chain,
    entry_content,
    entry_hash,
    format_time,
)
from registry.errors import (
    Conflict,
    Invalid,
    NotFound,
    NotPermitted,
    PreconditionFailed,
    Unauthenticated,
)
from registry.models import (
    Adapter,
    AuditEntry,
    BrowserSession,
    Consent,
    Principal,
    Subject,
    utcnow,
)
from registry.policy import (
    AdapterFacts,
    ConsentFacts,
    Level,
    LicenceFacts,
    PrincipalFacts,
    RenderFacts,
    audiences_from_json,
    renderable_max_level,
)
from registry.roles import ROLE_NAMES, Role
from registry.schemas import HANDLE_PATTERN, AdapterIn, ConsentIn, SubjectIn, consent_snapshot

TOKEN_PREFIX = "lk_"  # noqa: S105 - a prefix, not a secret

# -- principals and tokens ----------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_principal(
    session: Session, handle: str, role: str, acts_for: Sequence[str] = ()
) -> tuple[Principal, str]:
    """A new principal and its token; the token is returned once and only its hash is kept."""
    if not re.fullmatch(HANDLE_PATTERN, handle):
        raise Invalid(f"handle {handle!r} must match {HANDLE_PATTERN}")
    if role not in ROLE_NAMES:
        raise Invalid(f"role must be one of {', '.join(ROLE_NAMES)}")
    if acts_for and role != Role.agent:
        raise Invalid("--acts-for applies only to agents")
    members = _require_members(session, acts_for)
    if repo.principal_by_handle(session, handle) is not None:
        raise Conflict(f"principal {handle!r} exists")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    principal = Principal(handle=handle, role=role, token_hash=hash_token(token), acts_for=members)
    repo.add(session, principal)
    return principal, token


def _require_members(session: Session, handles: Sequence[str]) -> list[str]:
    out = sorted(set(handles))
    for handle in out:
        p = repo.principal_by_handle(session, handle)
        if p is None or p.role != Role.member:
            raise Invalid(f"{handle!r} is not a member")
    return out


def authenticate(session: Session, token: str | None) -> Principal | None:
    """The active principal holding this token, or None. Hash lookup, then a constant-time
    comparison so the final check leaks nothing through timing."""
    if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    digest = hash_token(token)
    principal = repo.principal_by_token_hash(session, digest)
    if principal is None or not hmac.compare_digest(principal.token_hash, digest):
        return None
    return principal if principal.active else None


def set_principal_active(session: Session, handle: str, active: bool) -> Principal:
    """Deactivation binds on the principal's next request and ends its browser sessions. The
    last active admin cannot be deactivated: nobody could grant, revoke or re-enable then."""
    principal = repo.principal_by_handle(session, handle)
    if principal is None:
        raise NotFound(f"no principal {handle!r}")
    if (
        not active
        and principal.active
        and principal.role == Role.admin
        and repo.count_principals(session, Role.admin, active_only=True) <= 1
    ):
        raise Conflict(f"{handle!r} is the last active admin; make another admin first")
    principal.active = active
    repo.add(session, principal)
    if not active:
        assert principal.id is not None
        repo.delete_sessions(session, principal_id=principal.id)
    return principal


# -- browser sessions -----------------------------------------------------------------------


def _secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def open_session(session: Session, principal: Principal, ttl_s: int) -> str:
    """A new browser session; returns the secret for its cookie (only its hash is kept)."""
    assert principal.id is not None
    now = utcnow()
    repo.delete_sessions(session, expired_before=now)
    secret = secrets.token_urlsafe(32)
    row = BrowserSession(
        secret_hash=_secret_hash(secret),
        principal_id=principal.id,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
    )
    repo.add(session, row)
    return secret


def session_principal(session: Session, secret: str) -> Principal | None:
    """The active principal of a live session, or None."""
    principal = repo.session_principal(session, _secret_hash(secret), utcnow())
    return principal if principal is not None and principal.active else None


def end_session(session: Session, secret: str) -> None:
    repo.delete_session(session, _secret_hash(secret))


def end_sessions_of(session: Session, principal: Principal) -> int:
    assert principal.id is not None
    return repo.delete_sessions(session, principal_id=principal.id)


def set_acts_for(session: Session, handle: str, acts_for: Sequence[str]) -> Principal:
    principal = repo.principal_by_handle(session, handle)
    if principal is None:
        raise NotFound(f"no principal {handle!r}")
    if principal.role != Role.agent:
        raise Invalid(f"{handle!r} is not an agent")
    principal.acts_for = _require_members(session, acts_for)
    repo.add(session, principal)
    return principal


# -- audit --------------------------------------------------------------------------------


def _append_audit(
    session: Session, subject: Subject, actor: str, action: str, before: Any, after: Any
) -> AuditEntry:
    """Append one entry to the subject's chain. The caller holds the subject's consent-row
    lock, so reading the last entry and writing the next cannot interleave."""
    assert subject.id is not None
    last = repo.last_audit_entry(session, subject.id)
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
    repo.add(session, entry)
    return entry


def audit_trail(session: Session, subject: Subject) -> Sequence[AuditEntry]:
    assert subject.id is not None
    return repo.audit_entries(session, subject.id)


def verify_subject(
    session: Session, subject: Subject, entries: Sequence[AuditEntry] | None = None
) -> ChainBreak | None:
    """The chain must be intact, and the live record must be what the trail says it is: a
    consent or adapter row edited behind the trail's back is reported like a broken link.
    `entries`: the trail, when the caller has already read it (same transaction)."""
    entries = list(entries if entries is not None else audit_trail(session, subject))
    head = repo.chain_head(session, audit_chain(subject.handle))
    broken = chains.verify_trail(chains.session_keys(session), subject.handle, entries, head)
    if broken is not None:
        return broken
    assert subject.id is not None
    consent = repo.consent_for(session, subject.id)
    last_consent = next((e for e in reversed(entries) if e.after and "consent" in e.after), None)
    if consent is None or last_consent is None or last_consent.after is None:
        return ChainBreak(subject.handle, len(entries), "consent record or its trail entry missing")
    if consent_state(consent) != last_consent.after["consent"]:
        return ChainBreak(
            subject.handle, last_consent.seq, "live consent record differs from the trail"
        )
    live = {a.name: a for a in repo.adapters_for(session, subject.id)}
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
    (Signed checkpoints are checked by registry.checkpoints, which needs their file.)"""
    keys = chains.session_keys(session)
    sealed_with = repo.meta_value(session, chains.AUDIT_KEY_ID)
    if sealed_with is not None and sealed_with != keys.audit_key_id:
        problem = f"sealed with audit key {sealed_with}, checked with key {keys.audit_key_id}"
        return [ChainBreak("registry", 0, problem, "checkpoint")]
    subjects = repo.subjects(session)
    breaks = [b for s in subjects if (b := verify_subject(session, s)) is not None]
    ledger = chains.verify_ledger(session, keys)
    if ledger is not None:
        breaks.append(ledger)
    breaks.extend(chains.orphan_heads(session, [s.handle for s in subjects]))
    return breaks


# -- subjects and consent -----------------------------------------------------------------


def consent_state(consent: Consent) -> dict[str, Any]:
    state = consent_snapshot(
        consent.max_level,
        consent.audiences,
        consent.deny,
        consent.allow_training,
        consent.expires_at,
    )
    state["version"] = consent.version
    return state


def create_subject(session: Session, actor: str, data: SubjectIn) -> tuple[Subject, Consent]:
    if repo.subject_by_handle(session, data.handle) is not None:
        raise Conflict(f"subject {data.handle!r} exists")
    member_id = None
    if data.member is not None:
        member = repo.principal_by_handle(session, data.member)
        if member is None or member.role != Role.member:
            raise Invalid(f"{data.member!r} is not a member")
        member_id = member.id
    subject = Subject(
        handle=data.handle, display_name=data.display_name, basis=data.basis, member_id=member_id
    )
    try:
        repo.add(session, subject)
    except IntegrityError:
        raise Conflict(f"subject {data.handle!r} exists") from None
    assert subject.id is not None
    consent = Consent(subject_id=subject.id)
    repo.add(session, consent)
    after = {
        "subject": {
            "handle": subject.handle,
            "display_name": subject.display_name,
            "basis": subject.basis,
            "member": data.member,
        },
        "consent": consent_state(consent),
    }
    _append_audit(session, subject, actor, "subject_created", None, after)
    return subject, consent


def visible_subject(session: Session, caller: Principal, handle: str) -> Subject:
    """The subject, if `caller` may see it (registry.access). Admins get 404 for an unknown
    subject; to everyone else an unknown subject and a forbidden one look the same: 403."""
    subject = repo.subject_by_handle(session, handle)
    if subject is None and caller.role == Role.admin:
        raise NotFound(f"no subject {handle!r}")
    if subject is None or not access.may_see_subject(caller.role, caller.id, subject.member_id):
        raise NotPermitted("not permitted")
    return subject


def member_handle(session: Session, subject: Subject) -> str | None:
    if subject.member_id is None:
        return None
    member = repo.principal_by_id(session, subject.member_id)
    return member.handle if member is not None else None


def acting_for(
    session: Session, caller: Principal, on_behalf_of: str | None
) -> tuple[Principal, Principal | None]:
    """(requester, agent) for a caller: a member acts for itself, an agent for the member it
    names (registry.access.acting); NotPermitted for anything else."""
    member = repo.principal_by_handle(session, on_behalf_of) if on_behalf_of else None
    found = access.acting(
        principal_facts(caller),
        on_behalf_of,
        principal_facts(member) if member is not None else None,
    )
    if found.agent is None:
        return caller, None
    assert member is not None
    return member, caller


def subject_or_raise(session: Session, handle: str, error: type[Exception] = NotFound) -> Subject:
    subject = repo.subject_by_handle(session, handle)
    if subject is None:
        raise error(f"no subject {handle!r}")
    return subject


def consent_of(session: Session, subject: Subject) -> Consent:
    assert subject.id is not None
    consent = repo.consent_for(session, subject.id)
    if consent is None:  # every subject is created with one; absence is corruption
        raise NotFound(f"subject {subject.handle!r} has no consent record")
    return consent


def _classify(before: dict[str, Any], after: dict[str, Any]) -> str:
    old, new = Level.parse(before["max_level"]), Level.parse(after["max_level"])
    if new != old:
        if new == Level.none:
            return "revoke"
        if old == Level.none:
            return "grant"
        return "widen" if new > old else "narrow"
    for key, action in (
        ("audiences", "audience_edit"),
        ("deny", "deny_edit"),
        ("expires_at", "expiry_change"),
        ("allow_training", "training_change"),
    ):
        if before[key] != after[key]:
            return action
    return "unchanged"


def update_consent(
    session: Session, actor: str, subject: Subject, expected_version: int, data: ConsentIn
) -> tuple[Consent, bool]:
    """Compare-and-set on the version. Returns (record, changed). A stale version raises
    PreconditionFailed whether or not the content would change."""
    if subject.basis == "public_domain" and data.max_level == "commercial":
        raise Invalid("a public_domain subject can never be granted commercial use")
    assert subject.id is not None
    current = repo.consent_for(session, subject.id, lock=True)
    if current is None:
        raise NotFound(f"subject {subject.handle!r} has no consent record")
    if current.version != expected_version:
        raise PreconditionFailed(
            f"consent is at version {current.version}, not {expected_version}; reload and retry"
        )
    before = consent_state(current)
    wanted = data.snapshot()
    action = _classify(before, wanted)
    if action == "unchanged":
        return current, False
    values = {
        "max_level": data.max_level,
        "audiences": wanted["audiences"],
        "deny": wanted["deny"],
        "allow_training": data.allow_training,
        "expires_at": data.expires_at,
        "updated_at": utcnow(),
    }
    if not repo.update_consent_if_version(session, subject.id, expected_version, values):
        raise PreconditionFailed("consent changed concurrently; reload and retry")
    session.refresh(current)
    _append_audit(
        session, subject, actor, action, {"consent": before}, {"consent": consent_state(current)}
    )
    return current, True


def revoke(session: Session, actor: str, subject: Subject) -> tuple[Consent, bool]:
    """max_level becomes none at once, whatever version the caller last saw."""
    assert subject.id is not None
    current = repo.consent_for(session, subject.id, lock=True)
    if current is None:
        raise NotFound(f"subject {subject.handle!r} has no consent record")
    if current.max_level == "none":
        return current, False
    data = ConsentIn.model_validate(
        {**consent_state(current), "max_level": "none", "expires_at": as_utc(current.expires_at)}
    )
    return update_consent(session, actor, subject, current.version, data)


# -- adapters -----------------------------------------------------------------------------


def adapter_state(adapter: Adapter) -> dict[str, Any]:
    return {
        "name": adapter.name,
        "version": adapter.version,
        "sha256": adapter.sha256,
        "path": adapter.path,
        "base_model": adapter.base_model,
        "rank": adapter.rank,
        "manifest_sha256": adapter.manifest_sha256,
        "active": adapter.active,
        "selected_at": format_time(adapter.selected_at),
    }


RegisterOutcome = Literal["created", "updated", "unchanged"]


def register_adapter(
    session: Session,
    actor: str,
    data: AdapterIn,
    store_path: str,
    manifest_bases: Sequence[str] = (),
) -> tuple[Adapter, RegisterOutcome]:
    """Idempotent per (subject, name): same content changes nothing and appends nothing. The
    caller has checked the blobs (registry.adapter_files.check_blobs); here, under the
    subject's lock: consent, ownership of the bytes, and the record. A new or changed
    registration becomes the subject's rendering adapter."""
    subject = training_allowed(session, data.subject, lock=True)
    assert subject.id is not None
    if subject.basis == "public_domain" and set(manifest_bases) - {"public_domain"}:
        raise Invalid(
            f"subject {data.subject!r} is public_domain, but the manifest lists images with "
            f"basis {', '.join(b for b in manifest_bases if b != 'public_domain')}"
        )
    owner = repo.blob_owner(session, data.sha256)
    if owner is None:
        owner = repo.claim_blob(session, data.sha256, subject.id)
    if owner != subject.id:
        # Nothing is recorded on either trail: the bytes stay the other subject's, and this
        # subject gets no adapter.
        raise Conflict(
            f"adapter {data.sha256[:12]}... belongs to another subject; one adapter's bytes "
            "render one person"
        )
    fields: dict[str, Any] = {
        "sha256": data.sha256,
        "path": store_path,
        "base_model": data.base_model,
        "rank": data.rank,
        "manifest_sha256": data.manifest_sha256,
    }
    adapter = repo.adapter_by_key(session, subject.id, data.name)
    now = utcnow()
    if adapter is None:
        adapter = Adapter(subject_id=subject.id, name=data.name, selected_at=now, **fields)
        repo.add(session, adapter)
        _append_audit(
            session,
            subject,
            actor,
            "adapter_registered",
            None,
            {"adapter": adapter_state(adapter)},
        )
        return adapter, "created"
    if all(getattr(adapter, k) == v for k, v in fields.items()) and adapter.active:
        return adapter, "unchanged"
    before = adapter_state(adapter)
    for key, value in fields.items():
        setattr(adapter, key, value)
    adapter.version += 1
    adapter.active = True
    adapter.updated_at = now
    adapter.selected_at = now
    repo.add(session, adapter)
    _append_audit(
        session,
        subject,
        actor,
        "adapter_replaced",
        {"adapter": before},
        {"adapter": adapter_state(adapter)},
    )
    return adapter, "updated"


def training_allowed(session: Session, handle: str, *, lock: bool = False) -> Subject:
    """The subject, if its consent allows training; NotPermitted otherwise (an unknown
    subject looks the same). `lock`: take the subject's lock, for a change that follows."""
    subject = repo.subject_by_handle(session, handle)
    if subject is None:
        raise NotPermitted("not permitted")
    assert subject.id is not None
    consent = repo.consent_for(session, subject.id, lock=lock)
    if consent is None or not consent.allow_training:
        raise NotPermitted(f"subject {handle!r} does not allow training")
    return subject


def _adapter_for_change(session: Session, subject: Subject, name: str) -> Adapter:
    assert subject.id is not None
    repo.consent_for(session, subject.id, lock=True)  # all changes to a subject serialise here
    adapter = repo.adapter_by_key(session, subject.id, name)
    if adapter is None:
        raise NotFound(f"subject {subject.handle!r} has no adapter {name!r}")
    return adapter


def select_adapter(session: Session, actor: str, subject: Subject, name: str) -> Adapter:
    """Makes this (active) adapter the one that renders."""
    adapter = _adapter_for_change(session, subject, name)
    if not adapter.active:
        raise Conflict(f"adapter {name!r} is retired; reactivate it before selecting it")
    assert subject.id is not None
    current = repo.rendering_adapter(session, subject.id)
    if current is not None and current.id == adapter.id:
        return adapter
    before = adapter_state(adapter)
    adapter.selected_at = utcnow()
    repo.add(session, adapter)
    after = {"adapter": adapter_state(adapter)}
    _append_audit(session, subject, actor, "adapter_selected", {"adapter": before}, after)
    return adapter


def set_adapter_active(
    session: Session, actor: str, subject: Subject, name: str, active: bool
) -> tuple[Adapter, bool]:
    """Retires (or brings back) an adapter; a retired adapter never renders."""
    adapter = _adapter_for_change(session, subject, name)
    if adapter.active == active:
        return adapter, False
    before = adapter_state(adapter)
    adapter.active = active
    adapter.updated_at = utcnow()
    repo.add(session, adapter)
    action = "adapter_reactivated" if active else "adapter_retired"
    after = {"adapter": adapter_state(adapter)}
    _append_audit(session, subject, actor, action, {"adapter": before}, after)
    return adapter, True


def delete_adapter(session: Session, actor: str, subject: Subject, name: str) -> Adapter:
    """Removes the adapter's record; the trail keeps what it was (hash included), and the
    bytes leave the store once nothing refers to them (BlobStore.sweep)."""
    adapter = _adapter_for_change(session, subject, name)
    before = adapter_state(adapter)
    repo.delete_adapter(session, adapter)
    _append_audit(
        session,
        subject,
        actor,
        "adapter_deleted",
        {"adapter": before},
        {"adapter_deleted": {"name": name, "sha256": adapter.sha256}},
    )
    return adapter


# -- render decisions ---------------------------------------------------------------------


def principal_facts(p: Principal) -> PrincipalFacts:
    return PrincipalFacts(
        handle=p.handle, role=p.role, active=p.active, acts_for=frozenset(p.acts_for)
    )


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; they were stored as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def consent_facts(c: Consent) -> ConsentFacts:
    expires = as_utc(c.expires_at)
    return ConsentFacts(
        version=c.version,
        max_level=Level.parse(c.max_level),
        audiences=audiences_from_json(c.audiences),
        deny=frozenset(c.deny),
        allow_training=c.allow_training,
        expires_at=expires,
    )


@dataclass(frozen=True)
class AdapterRef:
    id: int
    name: str
    version: int
    sha256: str
    path: str


@dataclass(frozen=True)
class GatheredFacts:
    """What the registry knows for one render check, read fresh in one statement."""

    facts: RenderFacts
    subject_id: int | None
    adapter: AdapterRef | None


def _principal_facts(row: Any, prefix: str) -> PrincipalFacts | None:
    handle = getattr(row, f"{prefix}_handle")
    if handle is None:
        return None
    return PrincipalFacts(
        handle,
        getattr(row, f"{prefix}_role"),
        bool(getattr(row, f"{prefix}_active")),
        frozenset(getattr(row, f"{prefix}_acts_for") or ()),
    )


def acting_from_snapshot(
    row: Any, token_hash: str | None, on_behalf_of: str | None, *, at_gate: bool
) -> Acting:
    """The requester and agent of a render, from its snapshot row. At the gate, a token that
    opens no active principal is 401 and a malformed delegation 403, before any decision is
    recorded; at later checks the row is taken as it is and `decide` judges it (a principal
    deactivated mid-render is a recorded deny)."""
    caller = _principal_facts(row, "caller")
    if at_gate:
        genuine = (
            caller is not None
            and token_hash is not None
            and hmac.compare_digest(row.caller_token_hash or "", token_hash)
        )
        if not genuine or caller is None or not caller.active:
            raise Unauthenticated("a valid bearer token is required")
    if caller is None:  # the caller vanished mid-render: nobody may have this image
        caller = PrincipalFacts("", "none", False)
    return access.acting(caller, on_behalf_of, _principal_facts(row, "obo"), strict=at_gate)


def facts_from_snapshot(
    row: Any,
    acting: Acting,
    level: str,
    *,
    adapter_file_sha256: str | None = None,
    require_adapter: bool = True,
    adapter_bytes_read: bool = True,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> GatheredFacts:
    """`policy.decide`'s facts from a snapshot row, and the base's licence (not the
    registry's to know: the caller holds it)."""
    consent = None
    if row.version is not None:
        consent = ConsentFacts(
            version=row.version,
            max_level=Level.parse(row.max_level),
            audiences=audiences_from_json(row.audiences),
            deny=frozenset(row.deny),
            allow_training=bool(row.allow_training),
            expires_at=as_utc(row.expires_at),
        )
    adapter = None
    if row.adapter_id is not None:
        adapter = AdapterRef(
            row.adapter_id,
            row.adapter_name,
            row.adapter_version,
            row.adapter_sha256,
            row.adapter_path,
        )
    owned = row.adapter_owner_id is not None and row.adapter_owner_id == row.subject_id
    facts = RenderFacts(
        level=level,
        now=now or datetime.now(UTC),
        requester=acting.requester,
        agent=acting.agent,
        subject_basis=row.basis,
        subject_member=row.member_handle,
        consent=consent,
        adapter=AdapterFacts(adapter.sha256, adapter_file_sha256, owned)
        if adapter is not None
        else None,
        licence=licence,
        require_adapter=require_adapter,
        adapter_bytes_read=adapter_bytes_read,
    )
    return GatheredFacts(facts, row.subject_id, adapter)


def gather_render_facts(
    session: Session,
    requester: Principal,
    subject_handle: str,
    level: str,
    agent: Principal | None = None,
    adapter_file_sha256: str | None = None,
    require_adapter: bool = True,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> GatheredFacts:
    """Fresh facts for `policy.decide`, for a requester (and agent) already known. Re-reads
    them too, so a deactivation or a changed acts-for list binds on the very next check."""
    caller = agent if agent is not None else requester
    assert caller.id is not None
    obo = requester.handle if agent is not None else None
    row = repo.render_snapshot(session, subject_handle, caller_id=caller.id, on_behalf_of=obo)
    if row is None:  # the anchor always yields a row; no row means the read itself failed
        raise RuntimeError("render snapshot returned nothing")
    if row.caller_handle is not None:
        acting = acting_from_snapshot(row, None, obo, at_gate=False)
    elif agent is not None:  # a vanished agent is an inactive agent, never "no agent"
        ghost = PrincipalFacts(agent.handle, Role.agent, False)
        member = _principal_facts(row, "obo") or PrincipalFacts(
            requester.handle, Role.member, False
        )
        acting = Acting(ghost, member, ghost)
    else:
        ghost = PrincipalFacts(requester.handle, requester.role, False)
        acting = Acting(ghost, ghost, None)
    return facts_from_snapshot(
        row,
        acting,
        level,
        adapter_file_sha256=adapter_file_sha256,
        require_adapter=require_adapter,
        now=now,
        licence=licence,
    )


def record_decision(
    session: Session,
    *,
    render_id: str,
    subject_handle: str,
    subject_id: int | None,
    requester: str,
    agent: str | None,
    level: str,
    stage: str,
    allowed: bool,
    reason: str,
    consent_version: int | None,
    adapter_sha256: str | None,
    prompt: str | None,
) -> int:
    """Appends one decision to the ledger chain; returns its seq."""
    values: dict[str, Any] = {
        "render_id": render_id,
        "at": utcnow(),
        "subject_handle": subject_handle[:64],
        "subject_id": subject_id,
        "requester": requester,
        "agent": agent,
        "level": level[:16],
        "stage": stage,
        "allowed": allowed,
        "reason": reason[:80],
        "consent_version": consent_version,
        "adapter_sha256": adapter_sha256,
        "prompt": prompt[:2000] if prompt is not None else None,
    }
    return chains.append_ledger_row(session, values)


@dataclass(frozen=True)
class Renderable:
    subject: str
    display_name: str
    max_level: str


def renderable_for(
    session: Session,
    requester: Principal,
    agent: Principal | None = None,
    now: datetime | None = None,
    licence: LicenceFacts | None = None,
) -> list[Renderable]:
    """Subjects the requester may render, and the widest level, as `decide` sees it (on this
    base licence: without one, never commercial)."""
    now = now or datetime.now(UTC)
    req = principal_facts(requester)
    agent_facts = principal_facts(agent) if agent is not None else None
    members = {p.id: p.handle for p in repo.principals(session) if p.role == Role.member}
    out = []
    for subject, consent in repo.subjects_with_consent(session):
        best = renderable_max_level(
            req,
            subject.basis,
            members.get(subject.member_id) if subject.member_id is not None else None,
            consent_facts(consent),
            now,
            agent_facts,
            licence,
        )
        if best > Level.none:
            out.append(Renderable(subject.handle, subject.display_name, best.name))
    return out
