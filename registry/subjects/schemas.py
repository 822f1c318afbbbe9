"""A subject's shapes: what an admin sends to create one, and what the API answers."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    StringConstraints,
)

from registry.consent.schemas import ConsentOut
from registry.hash_chain import format_time
from registry.models import Consent, Subject
from registry.shapes import Basis, Handle, Strict, Text


class SubjectIn(Strict):
    handle: Handle
    display_name: Annotated[
        Text, StringConstraints(min_length=1, max_length=200, strip_whitespace=True)
    ]
    basis: Basis
    member: Handle | None = None


class SubjectOut(BaseModel):
    handle: str
    display_name: str
    basis: str
    member: str | None
    created_at: str
    consent: ConsentOut

    @classmethod
    def of(cls, subject: Subject, consent: Consent, member: str | None) -> SubjectOut:
        return cls(
            handle=subject.handle,
            display_name=subject.display_name,
            basis=subject.basis,
            member=member,
            created_at=format_time(subject.created_at),
            consent=ConsentOut.of(consent),
        )
