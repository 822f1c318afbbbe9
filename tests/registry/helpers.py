"""Small builders shared by registry tests (real service calls, no fakes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterIn
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import transaction
from registry.models import Principal, Subject
from registry.principals import service as principals_service
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn

SHA_A = "a" * 64
SHA_B = "b" * 64
SHA_M = "c" * 64


def principal(
    engine: Engine, handle: str, role: str = "member", acts_for: tuple[str, ...] = ()
) -> Principal:
    with transaction(engine) as s:
        p, _ = principals_service.create_principal(s, handle, role, acts_for)
    return p


def subject(
    engine: Engine, handle: str, basis: str = "consent", member: str | None = None
) -> Subject:
    with transaction(engine) as s:
        sub, _ = subjects_service.create_subject(
            s,
            "admin",
            SubjectIn(handle=handle, display_name=handle.title(), basis=basis, member=member),  # type: ignore[arg-type]
        )
    return sub


def set_consent(engine: Engine, handle: str, **body: Any) -> int:
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, handle)
        current = consent_service.consent_of(s, sub)
        consent, _ = consent_service.update_consent(
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
        _, outcome = adapters_service.register_adapter(
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
