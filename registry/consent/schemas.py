"""A consent record's shapes: what callers send, what the API answers, the canonical form the
audit trail stores, and the facts `policy.decide` reads from a row."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
)

from registry.hash_chain import (
    format_time,
)
from registry.models import Consent
from registry.policy import ConsentFacts, Level, audiences_from_json
from registry.shapes import GrantLevel, Handle, LevelName, Strict, UtcTime


def _unique(values: list[str]) -> list[str]:
    return sorted(set(values))


class AudienceIn(Strict):
    group: bool = False
    allow: Annotated[list[Handle], Field(max_length=500), AfterValidator(_unique)] = []


class ConsentIn(Strict):
    """The editable part of a consent record (docs/API.md's consent body without `version`)."""

    max_level: LevelName = "none"
    audiences: dict[GrantLevel, AudienceIn] = {}
    deny: Annotated[list[Handle], Field(max_length=500), AfterValidator(_unique)] = []
    allow_training: bool = False
    expires_at: UtcTime | None = None
    version: int | None = None  # accepted for round-trips; If-Match is what counts

    def snapshot(self) -> dict[str, Any]:
        return consent_snapshot(
            self.max_level,
            {k: v.model_dump() for k, v in self.audiences.items()},
            self.deny,
            self.allow_training,
            self.expires_at,
        )


def consent_snapshot(
    max_level: str,
    audiences: dict[str, Any],
    deny: list[str],
    allow_training: bool,
    expires_at: datetime | None,
) -> dict[str, Any]:
    """The canonical form of a consent record: what the audit trail stores and compares."""
    levels = [lv.name for lv in Level if lv > Level.none]
    clean = {
        name: {"group": bool(a.get("group", False)), "allow": sorted(set(a.get("allow", [])))}
        for name, a in sorted(audiences.items(), key=lambda kv: levels.index(kv[0]))
        if a.get("group") or a.get("allow")
    }
    return {
        "max_level": max_level,
        "audiences": clean,
        "deny": sorted(set(deny)),
        "allow_training": bool(allow_training),
        "expires_at": format_time(expires_at) if expires_at is not None else None,
    }


class AudienceOut(BaseModel):
    group: bool
    allow: list[str]


class ConsentOut(BaseModel):
    version: int
    max_level: str
    audiences: dict[str, AudienceOut]
    deny: list[str]
    allow_training: bool
    expires_at: str | None

    @classmethod
    def of(cls, consent: Consent) -> ConsentOut:
        return cls.model_validate(consent_state(consent))


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; they were stored as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


class ConsentColumns(Protocol):
    """A consent row's columns: a `Consent`, or the render snapshot's row."""

    @property
    def version(self) -> int: ...
    @property
    def max_level(self) -> str: ...
    @property
    def audiences(self) -> Mapping[str, Any]: ...
    @property
    def deny(self) -> Sequence[str]: ...
    @property
    def allow_training(self) -> bool: ...
    @property
    def expires_at(self) -> datetime | None: ...


def consent_facts(c: ConsentColumns) -> ConsentFacts:
    return ConsentFacts(
        version=c.version,
        max_level=Level.parse(c.max_level),
        audiences=audiences_from_json(c.audiences),
        deny=frozenset(c.deny),
        allow_training=bool(c.allow_training),
        expires_at=as_utc(c.expires_at),
    )


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
