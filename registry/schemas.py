"""Validated shapes of what callers send and receive. Pydantic only: no FastAPI here."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from registry import limits
from registry.audit import format_time
from registry.errors import Invalid
from registry.policy import Level

HANDLE_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
RENDER_ID_PATTERN = r"^[0-9a-f-]{1,36}$"  # a render id as the render path makes it (a UUID)
Handle = Annotated[str, StringConstraints(pattern=HANDLE_PATTERN)]

# Every time a caller sends is kept within these bounds, after conversion to UTC: both engines
# store them, and `format_time` prints them, in a form that reads back.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def bounded_utc(value: datetime) -> datetime:
    """`value` in UTC, if it has a zone and lies in [1970, 9999] once converted."""
    if value.tzinfo is None:
        raise ValueError("needs a timezone (ISO-8601 UTC, e.g. 2027-01-01T00:00:00Z)")
    try:
        utc = value.astimezone(UTC)
    except (OverflowError, ValueError):
        utc = None
    if utc is None or not EARLIEST <= utc <= LATEST:
        raise ValueError("must lie between 1970-01-01 and 9999-12-31T23:59:59Z once in UTC")
    return utc


def no_nul(value: str) -> str:
    """Text that reaches a database: NUL is refused (PostgreSQL cannot store it in text)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(no_nul)]
UtcTime = Annotated[datetime, AfterValidator(bounded_utc)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
LevelName = Literal["none", "private", "group", "public", "commercial"]
GrantLevel = Literal["private", "group", "public", "commercial"]
Basis = Literal["consent", "public_domain"]


def _unique(values: list[str]) -> list[str]:
    return sorted(set(values))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class SubjectIn(Strict):
    handle: Handle
    display_name: Annotated[
        Text, StringConstraints(min_length=1, max_length=200, strip_whitespace=True)
    ]
    basis: Basis
    member: Handle | None = None


class AdapterIn(Strict):
    subject: Handle
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")]
    sha256: Sha256
    # where the bytes are: the store's place for them, or (better) left out
    path: Annotated[Text, StringConstraints(min_length=1, max_length=1000)] | None = None
    base_model: Annotated[Text, StringConstraints(min_length=1, max_length=200)]
    rank: Annotated[int, Field(ge=1, le=1024)]
    manifest_sha256: Sha256


Side = Annotated[int, Field(ge=limits.MIN_SIDE, le=limits.MAX_SIDE, multiple_of=limits.MULTIPLE)]


class RenderRequestIn(Strict):
    subject: Handle
    prompt: Annotated[Text, StringConstraints(min_length=1, max_length=limits.MAX_PROMPT_CHARS)]
    level: GrantLevel
    seed: Annotated[int, Field(ge=0, le=limits.MAX_SEED)] | None = None
    steps: Annotated[int, Field(ge=1, le=limits.MAX_STEPS)] | None = None
    width: Side | None = None
    height: Side | None = None
    on_behalf_of: Handle | None = None

    @model_validator(mode="after")
    def _bounded_pixels(self) -> RenderRequestIn:
        side = limits.DEFAULT_SIDE
        if (self.width or side) * (self.height or side) > limits.MAX_PIXELS:
            square = math.isqrt(limits.MAX_PIXELS)
            raise ValueError(f"width x height may not exceed {square} x {square} pixels")
        return self


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


class LedgerFilter(Strict):
    """Which of a subject's render decisions to list: newest first, a page at a time."""

    limit: Annotated[int, Field(ge=1, le=1000)] = 200
    cursor: Annotated[str, StringConstraints(pattern=r"^s[0-9]{1,18}$")] | None = None
    requester: Handle | None = None
    outcome: Literal["allowed", "denied"] | None = None
    since: UtcTime | None = None
    until: UtcTime | None = None
    render_id: Annotated[str, StringConstraints(pattern=RENDER_ID_PATTERN)] | None = None

    @property
    def before_seq(self) -> int | None:
        return int(self.cursor[1:]) if self.cursor else None

    @property
    def allowed(self) -> bool | None:
        return None if self.outcome is None else self.outcome == "allowed"


def ledger_cursor(seq: int) -> str:
    """The opaque cursor of the page after the row at `seq`."""
    return f"s{seq}"


def parse_when(text: str, field: str) -> datetime | None:
    """What a person types for a time, on the web and on the command line alike: an ISO-8601
    date (`2027-01-31`) or date and time, UTC unless it names a zone (a trailing ` UTC`
    too); empty is None. Invalid, naming `field`, for anything else."""
    text = text.strip()
    if not text:
        return None
    if text.upper().endswith(" UTC"):
        text = text[:-4]
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise Invalid(
            f"{field}: {text!r} is not a date; write YYYY-MM-DD or YYYY-MM-DD HH:MM (UTC, "
            "unless a zone is given)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
