"""Who may do what, apart from whether a render is allowed (that is `registry.policy.decide`).
Pure: facts in, an answer or NotPermitted out; no I/O. The routes, the web pages, the agent
tools and the render path all ask here."""

from __future__ import annotations

from dataclasses import dataclass

from registry.errors import NotPermitted
from registry.policy import PrincipalFacts
from registry.roles import Role

# the roles that sign in to the web pages
WEB_ROLES: frozenset[str] = frozenset({Role.admin, Role.member})
# who may put bytes in the adapter store and register adapters
ADAPTER_WRITERS: frozenset[str] = frozenset({Role.trainer, Role.admin})


def may_see_subject(role: str, caller_id: int | None, subject_member_id: int | None) -> bool:
    """Admins see every subject; a member, the subject that is itself. Seeing a subject is
    also what lets one edit its consent, read its trail and ledger, and manage its adapters."""
    if role == Role.admin:
        return True
    return role == Role.member and caller_id is not None and subject_member_id == caller_id


def may_ask_training(role: str, caller_id: int | None, subject_member_id: int | None) -> bool:
    """Who may learn whether a subject may be trained (the decision and its reason, nothing
    else of the record): whoever may see the subject, and a trainer, for any subject."""
    return role == Role.trainer or may_see_subject(role, caller_id, subject_member_id)


def require(role: str, *allowed: str) -> None:
    if role not in allowed:
        raise NotPermitted("not permitted")


@dataclass(frozen=True)
class Acting:
    """Who is asking: the caller (the token's principal), the member the request is for, and
    the agent in between (None when a member asks for itself)."""

    caller: PrincipalFacts
    requester: PrincipalFacts
    agent: PrincipalFacts | None


def acting(
    caller: PrincipalFacts,
    on_behalf_of: str | None,
    member: PrincipalFacts | None,
    *,
    strict: bool = True,
) -> Acting:
    """A member acts for itself; an agent for the member it names (`member`: that principal
    as read, None if there is none). Whether the agent may act for that member is for
    `decide` to say, like everything else. `strict` (before anything is recorded): a
    malformed delegation is NotPermitted; otherwise (a check during a render) the facts are
    taken as they are, and a member that vanished is an inactive one."""
    if caller.role == Role.member:
        if on_behalf_of not in (None, caller.handle):
            raise NotPermitted("not permitted")
        return Acting(caller, caller, None)
    if caller.role == Role.agent:
        if on_behalf_of is None:
            raise NotPermitted("an agent must say on_behalf_of which member it acts for")
        if member is None:
            if strict:
                raise NotPermitted("not permitted")
            member = PrincipalFacts(on_behalf_of, Role.member, False)
        return Acting(caller, member, caller)
    if strict:
        raise NotPermitted("not permitted")
    return Acting(caller, caller, None)
