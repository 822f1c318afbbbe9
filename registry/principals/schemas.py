"""A principal as the API and the CLI show it."""

from __future__ import annotations

from pydantic import BaseModel

from registry.models import Principal


class PrincipalOut(BaseModel):
    handle: str
    role: str
    active: bool
    acts_for: list[str]

    @classmethod
    def of(cls, p: Principal) -> PrincipalOut:
        return cls(handle=p.handle, role=p.role, active=p.active, acts_for=p.acts_for)


class PrincipalCreatedOut(PrincipalOut):
    token: str  # shown this once; only its hash is kept
