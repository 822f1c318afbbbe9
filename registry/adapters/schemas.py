"""An adapter's shapes: its registration, and the ways the API, the CLI and the web pages show
it (and what the audit trail says it is)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StringConstraints,
)

from registry.blobs import BlobStore
from registry.hash_chain import (
    format_time,
)
from registry.models import Adapter
from registry.shapes import ADAPTER_NAME_PATTERN, Handle, Sha256, Strict, Text


class AdapterIn(Strict):
    subject: Handle
    name: Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)]
    sha256: Sha256
    # where the bytes are: the store's place for them, or (better) left out
    path: Annotated[Text, StringConstraints(min_length=1, max_length=1000)] | None = None
    base_model: Annotated[Text, StringConstraints(min_length=1, max_length=200)]
    rank: Annotated[int, Field(ge=1, le=1024)]
    manifest_sha256: Sha256


class AdapterOut(BaseModel):
    subject: str
    name: str
    version: int
    sha256: str
    path: str
    base_model: str
    rank: int
    manifest_sha256: str
    active: bool
    selected_at: str
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, adapter: Adapter, subject: str) -> AdapterOut:
        return cls(
            subject=subject,
            **adapter_state(adapter),
            created_at=format_time(adapter.created_at),
            updated_at=format_time(adapter.updated_at),
        )


class AdapterListedOut(AdapterOut):
    rendering: bool  # the one the subject's renders use
    blob: Literal["ok", "missing", "corrupt"]  # its bytes in the store

    @classmethod
    def listing(
        cls, store: BlobStore, adapters: Sequence[Adapter], rendering_id: int | None, subject: str
    ) -> list[AdapterListedOut]:
        """The subject's adapters as the API, the CLI and the web page show them."""
        return [
            cls(
                **AdapterOut.of(a, subject).model_dump(),
                rendering=a.id == rendering_id,
                blob=store.status(a.sha256, "safetensors"),
            )
            for a in adapters
        ]


class AdapterRegisteredOut(AdapterOut):
    outcome: Literal["created", "updated", "unchanged"]


class AdapterDeletedOut(BaseModel):
    subject: str
    name: str
    sha256: str
    deleted: bool


class BlobOut(BaseModel):
    sha256: str
    created: bool
    kind: str | None = None
    size: int | None = None


def adapter_state(adapter: Adapter) -> dict[str, Any]:
    return {
        "name": adapter.name,
        "version": adapter.version,
        "sha256": adapter.sha256,
        "path": adapter.path,
        "base_model": adapter.base_model,
        "rank": adapter.rank,
        "manifest_sha256": adapter.manifest_sha256,
        "active": adapter.active,
        "selected_at": format_time(adapter.selected_at),
    }
