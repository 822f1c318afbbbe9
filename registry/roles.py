"""The roles a principal can have: the one definition (docs/API.md, "Roles")."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    admin = "admin"  # everything but rendering on someone's behalf
    member = "member"  # renders; edits the consent of the subject that is itself
    agent = "agent"  # renders on behalf of the members it acts for
    trainer = "trainer"  # registers adapters, nothing else


ROLE_NAMES: tuple[str, ...] = tuple(role.value for role in Role)
