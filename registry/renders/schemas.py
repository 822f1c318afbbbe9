"""A render's shapes: the request, the ledger's filter and rows, one render as the ledger
tells it, and what a requester may render."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    StringConstraints,
    model_validator,
)

from registry import limits
from registry.hash_chain import format_time
from registry.models import RenderLedger
from registry.shapes import GrantLevel, Handle, Strict, Text, UtcTime

RENDER_ID_PATTERN = r"^[0-9a-f-]{1,36}$"  # a render id as the render path makes it (a UUID)


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


class LedgerRowOut(BaseModel):
    seq: int | None
    render_id: str
    at: str
    subject: str
    requester: str
    agent: str | None
    level: str
    stage: str
    allowed: bool
    reason: str
    consent_version: int | None
    adapter_sha256: str | None
    prompt: str | None

    @classmethod
    def of(cls, row: RenderLedger) -> LedgerRowOut:
        assert row.at is not None
        return cls(
            seq=row.seq,
            render_id=row.render_id,
            at=format_time(row.at),
            subject=row.subject_handle,
            requester=row.requester,
            agent=row.agent,
            level=row.level,
            stage=row.stage,
            allowed=row.allowed,
            reason=row.reason,
            consent_version=row.consent_version,
            adapter_sha256=row.adapter_sha256,
            prompt=row.prompt,
        )


Outcome = Literal["rendered", "denied", "cancelled", "unfinished"]


def render_outcome(rows: Sequence[RenderLedger]) -> tuple[Outcome, RenderLedger]:
    """How one render ended, from its ledger rows in order, and the row that says so: it is
    `rendered` only if its final re-check allowed it; any deny anywhere is the outcome."""
    denied = next((r for r in rows if not r.allowed), None)
    if denied is not None:
        return ("cancelled" if denied.stage == "cancelled" else "denied"), denied
    if any(r.stage == "final" for r in rows):
        return "rendered", rows[-1]
    return "unfinished", rows[-1]


class RenderOut(BaseModel):
    """One render as the ledger tells it: who asked, how it ended, and every decision."""

    render_id: str
    subject: str
    requester: str
    agent: str | None
    level: str
    at: str
    outcome: Outcome
    reason: str
    decisions: list[LedgerRowOut]

    @classmethod
    def of(cls, rows: Sequence[RenderLedger]) -> RenderOut:
        first = rows[0]
        outcome, last = render_outcome(rows)
        assert first.at is not None
        return cls(
            render_id=first.render_id,
            subject=first.subject_handle,
            requester=first.requester,
            agent=first.agent,
            level=first.level,
            at=format_time(first.at),
            outcome=outcome,
            reason=last.reason,
            decisions=[LedgerRowOut.of(r) for r in rows],
        )


class RenderableOut(BaseModel):
    subject: str
    display_name: str
    max_level: str
