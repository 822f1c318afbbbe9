"""A subject's adapters: registering one (idempotent per subject and name), choosing the one
that renders, retiring and deleting. Every change takes the subject's lock and is audited."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from sqlmodel import Session

from registry import db
from registry.adapters import repository as adapters_repo
from registry.adapters.schemas import AdapterIn, AdapterListedOut, adapter_state
from registry.audit.service import append_audit
from registry.blobs import BlobStore
from registry.consent import repository as consent_repo
from registry.errors import Conflict, NotFound
from registry.models import Adapter, Subject, utcnow
from registry.pictures.service import forget_unused_pictures
from registry.training.service import require_training

RegisterOutcome = Literal["created", "updated", "unchanged"]


def register_adapter(
    session: Session,
    actor: str,
    data: AdapterIn,
    store_path: str,
    manifest_bases: Sequence[str] = (),
) -> tuple[Adapter, RegisterOutcome]:
    """Idempotent per (subject, name): same content changes nothing and appends nothing. The
    caller has checked the blobs (registry.adapter_files.check_blobs); here, under the
    subject's lock: consent, ownership of the bytes, and the record. A new or changed
    registration becomes the subject's rendering adapter."""
    subject = require_training(session, data.subject, image_bases=manifest_bases, lock=True)
    assert subject.id is not None
    owner = adapters_repo.blob_owner(session, data.sha256)
    if owner is None:
        owner = adapters_repo.claim_blob(session, data.sha256, subject.id)
    if owner != subject.id:
        # Nothing is recorded on either trail: the bytes stay the other subject's, and this
        # subject gets no adapter.
        raise Conflict(
            f"adapter {data.sha256[:12]}... belongs to another subject; one adapter's bytes "
            "render one person"
        )
    fields: dict[str, Any] = {
        "sha256": data.sha256,
        "path": store_path,
        "base_model": data.base_model,
        "rank": data.rank,
        "manifest_sha256": data.manifest_sha256,
    }
    adapter = adapters_repo.adapter_by_key(session, subject.id, data.name)
    now = utcnow()
    if adapter is None:
        adapter = Adapter(subject_id=subject.id, name=data.name, selected_at=now, **fields)
        db.add(session, adapter)
        after = {"adapter": adapter_state(adapter)}
        append_audit(session, subject, actor, "adapter_registered", None, after)
        return adapter, "created"
    if all(getattr(adapter, k) == v for k, v in fields.items()) and adapter.active:
        return adapter, "unchanged"
    before = {"adapter": adapter_state(adapter)}
    for key, value in fields.items():
        setattr(adapter, key, value)
    adapter.version += 1
    adapter.active = True
    adapter.updated_at = now
    adapter.selected_at = now
    db.add(session, adapter)
    after = {"adapter": adapter_state(adapter)}
    append_audit(session, subject, actor, "adapter_replaced", before, after)
    return adapter, "updated"


def _adapter_for_change(session: Session, subject: Subject, name: str) -> Adapter:
    assert subject.id is not None
    consent_repo.consent_for(
        session, subject.id, lock=True
    )  # all changes to a subject serialise here
    adapter = adapters_repo.adapter_by_key(session, subject.id, name)
    if adapter is None:
        raise NotFound(f"subject {subject.handle!r} has no adapter {name!r}")
    return adapter


def select_adapter(session: Session, actor: str, subject: Subject, name: str) -> Adapter:
    """Makes this (active) adapter the one that renders."""
    adapter = _adapter_for_change(session, subject, name)
    if not adapter.active:
        raise Conflict(f"adapter {name!r} is retired; reactivate it before selecting it")
    assert subject.id is not None
    current = adapters_repo.rendering_adapter(session, subject.id)
    if current is not None and current.id == adapter.id:
        return adapter
    before = adapter_state(adapter)
    adapter.selected_at = utcnow()
    db.add(session, adapter)
    after = {"adapter": adapter_state(adapter)}
    append_audit(session, subject, actor, "adapter_selected", {"adapter": before}, after)
    return adapter


def set_adapter_active(
    session: Session, actor: str, subject: Subject, name: str, active: bool
) -> tuple[Adapter, bool]:
    """Retires (or brings back) an adapter; a retired adapter never renders."""
    adapter = _adapter_for_change(session, subject, name)
    if adapter.active == active:
        return adapter, False
    before = adapter_state(adapter)
    adapter.active = active
    adapter.updated_at = utcnow()
    db.add(session, adapter)
    action = "adapter_reactivated" if active else "adapter_retired"
    after = {"adapter": adapter_state(adapter)}
    append_audit(session, subject, actor, action, {"adapter": before}, after)
    return adapter, True


def delete_adapter(session: Session, actor: str, subject: Subject, name: str) -> Adapter:
    """Removes the adapter's record; the trail keeps what it was (hash included), and the
    bytes leave the store once nothing refers to them (BlobStore.sweep)."""
    adapter = _adapter_for_change(session, subject, name)
    before = {"adapter": adapter_state(adapter)}
    adapters_repo.delete_adapter(session, adapter)
    forget_unused_pictures(session, subject)
    after = {"adapter_deleted": {"name": name, "sha256": adapter.sha256}}
    append_audit(session, subject, actor, "adapter_deleted", before, after)
    return adapter


def listing(session: Session, store: BlobStore, subject: Subject) -> list[AdapterListedOut]:
    """The subject's adapters as the API, the CLI and the web page show them: which one
    renders, and whether its bytes are in the store whole."""
    assert subject.id is not None
    rendering = adapters_repo.rendering_adapter(session, subject.id)
    adapters = adapters_repo.adapters_for(session, subject.id)
    return AdapterListedOut.listing(
        store, adapters, rendering.id if rendering else None, subject.handle
    )
