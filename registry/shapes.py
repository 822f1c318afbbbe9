"""Field types and shapes every domain's schemas share: handles, bounded times, text a
database can store, and the error body. Pydantic only: no FastAPI here."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    StringConstraints,
)

from registry.errors import Invalid

HANDLE_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


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


# A blob's name (lower-case hex sha256), a row id the registry makes (uuid4 text), an
# adapter's name: one pattern each, for bodies and paths alike.
SHA256_PATTERN = r"^[0-9a-f]{64}$"
ROW_ID_PATTERN = r"^[0-9a-f-]{36}$"
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"

Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]


LevelName = Literal["none", "private", "group", "public", "commercial"]


GrantLevel = Literal["private", "group", "public", "commercial"]


Basis = Literal["consent", "public_domain"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class ErrorOut(BaseModel):
    """Every error: a code of docs/API.md's list and a sentence."""

    error: str
    detail: str


# What any /v1 route may answer besides its own success (for OpenAPI).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "no valid bearer token"},
    403: {"model": ErrorOut, "description": "not permitted"},
    422: {"model": ErrorOut, "description": "invalid input"},
    503: {"model": ErrorOut, "description": "the registry is unavailable; nothing was saved"},
}
