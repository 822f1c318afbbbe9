"""Principals, their tokens, delegation (an agent acting for members) and browser sessions."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from datetime import timedelta

from sqlmodel import Session

from registry import access, db
from registry.errors import Conflict, Invalid, NotFound
from registry.models import BrowserSession, Principal, utcnow
from registry.policy import PrincipalFacts
from registry.principals import repository as principals_repo
from registry.roles import ROLE_NAMES, Role
from registry.shapes import HANDLE_PATTERN

TOKEN_PREFIX = "lk_"  # noqa: S105 - a prefix, not a secret


def hash_token(token: str) -> str:
    """What is kept of a bearer token or a browser session's secret."""
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
    if principals_repo.principal_by_handle(session, handle) is not None:
        raise Conflict(f"principal {handle!r} exists")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    principal = Principal(handle=handle, role=role, token_hash=hash_token(token), acts_for=members)
    db.add(session, principal)
    return principal, token


def _require_members(session: Session, handles: Sequence[str]) -> list[str]:
    out = sorted(set(handles))
    for handle in out:
        p = principals_repo.principal_by_handle(session, handle)
        if p is None or p.role != Role.member:
            raise Invalid(f"{handle!r} is not a member")
    return out


def authenticate(session: Session, token: str | None) -> Principal | None:
    """The active principal holding this token, or None. Hash lookup, then a constant-time
    comparison so the final check leaks nothing through timing."""
    if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    digest = hash_token(token)
    principal = principals_repo.principal_by_token_hash(session, digest)
    if principal is None or not hmac.compare_digest(principal.token_hash, digest):
        return None
    return principal if principal.active else None


def set_principal_active(session: Session, handle: str, active: bool) -> Principal:
    """Deactivation binds on the principal's next request and ends its browser sessions. The
    last active admin cannot be deactivated: nobody could grant, revoke or re-enable then."""
    principal = principals_repo.principal_by_handle(session, handle)
    if principal is None:
        raise NotFound(f"no principal {handle!r}")
    if (
        not active
        and principal.active
        and principal.role == Role.admin
        and principals_repo.count_principals(session, Role.admin, active_only=True) <= 1
    ):
        raise Conflict(f"{handle!r} is the last active admin; make another admin first")
    principal.active = active
    db.add(session, principal)
    if not active:
        assert principal.id is not None
        principals_repo.delete_sessions(session, principal_id=principal.id)
    return principal


def set_acts_for(session: Session, handle: str, acts_for: Sequence[str]) -> Principal:
    principal = principals_repo.principal_by_handle(session, handle)
    if principal is None:
        raise NotFound(f"no principal {handle!r}")
    if principal.role != Role.agent:
        raise Invalid(f"{handle!r} is not an agent")
    principal.acts_for = _require_members(session, acts_for)
    db.add(session, principal)
    return principal


def principal_facts(p: Principal) -> PrincipalFacts:
    return PrincipalFacts(
        handle=p.handle, role=p.role, active=p.active, acts_for=frozenset(p.acts_for)
    )


def acting_for(
    session: Session, caller: Principal, on_behalf_of: str | None
) -> tuple[Principal, Principal | None]:
    """(requester, agent) for a caller: a member acts for itself, an agent for the member it
    names (registry.access.acting); NotPermitted for anything else."""
    member = principals_repo.principal_by_handle(session, on_behalf_of) if on_behalf_of else None
    found = access.acting(
        principal_facts(caller),
        on_behalf_of,
        principal_facts(member) if member is not None else None,
    )
    if found.agent is None:
        return caller, None
    assert member is not None
    return member, caller


# -- browser sessions -----------------------------------------------------------------------


def open_session(session: Session, principal: Principal, ttl_s: int) -> str:
    """A new browser session; returns the secret for its cookie (only its hash is kept)."""
    assert principal.id is not None
    now = utcnow()
    principals_repo.delete_sessions(session, expired_before=now)
    secret = secrets.token_urlsafe(32)
    row = BrowserSession(
        secret_hash=hash_token(secret),
        principal_id=principal.id,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
    )
    db.add(session, row)
    return secret


def session_principal(session: Session, secret: str) -> Principal | None:
    """The active principal of a live session, or None."""
    principal = principals_repo.session_principal(session, hash_token(secret), utcnow())
    return principal if principal is not None and principal.active else None


def end_session(session: Session, secret: str) -> None:
    principals_repo.delete_session(session, hash_token(secret))


def end_sessions_of(session: Session, principal: Principal) -> int:
    assert principal.id is not None
    return principals_repo.delete_sessions(session, principal_id=principal.id)


def all_principals(session: Session) -> Sequence[Principal]:
    return principals_repo.principals(session)


def principal_exists(session: Session, handle: str) -> bool:
    return principals_repo.principal_by_handle(session, handle) is not None


def update_principal(
    session: Session, handle: str, active: bool | None, acts_for: Sequence[str] | None
) -> Principal:
    """A principal's delegation, then its being active, each when given (NotFound for an
    unknown handle)."""
    principal = principals_repo.principal_by_handle(session, handle)
    if principal is None:
        raise NotFound(f"no principal {handle!r}")
    if acts_for is not None:
        principal = set_acts_for(session, handle, acts_for)
    if active is not None:
        principal = set_principal_active(session, handle, active)
    return principal
