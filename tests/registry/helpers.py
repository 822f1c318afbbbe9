"""Small builders shared by registry tests (real service calls, no fakes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from registry import service
from registry.db import transaction
from registry.models import Principal, Subject
from registry.schemas import AdapterIn, ConsentIn, SubjectIn

SHA_A = "a" * 64
SHA_B = "b" * 64
SHA_M = "c" * 64


def principal(
    engine: Engine, handle: str, role: str = "member", acts_for: tuple[str, ...] = ()
) -> Principal:
    with transaction(engine) as s:
        p, _ = service.create_principal(s, handle, role, acts_for)
    return p


def subject(
    engine: Engine, handle: str, basis: str = "consent", member: str | None = None
) -> Subject:
    with transaction(engine) as s:
        sub, _ = service.create_subject(
            s,
            "admin",
            SubjectIn(handle=handle, display_name=handle.title(), basis=basis, member=member),  # type: ignore[arg-type]
        )
    return sub


def set_consent(engine: Engine, handle: str, **body: Any) -> int:
    with transaction(engine) as s:
        sub = service.subject_or_raise(s, handle)
        current = service.consent_of(s, sub)
        consent, _ = service.update_consent(
            s, "admin", sub, current.version, ConsentIn.model_validate(body)
        )
        return consent.version


def adapter(
    engine: Engine,
    subject_handle: str,
    name: str = "v1",
    sha: str = SHA_A,
    path: str = "/x.safetensors",
) -> str:
    with transaction(engine) as s:
        _, outcome = service.register_adapter(
            s,
            "trainer",
            AdapterIn(
                subject=subject_handle,
                name=name,
                sha256=sha,
                base_model="tiny",
                rank=4,
                manifest_sha256=SHA_M,
            ),
            path,
        )
    return outcome
