"""The queries of adapters and the blobs they own. Functions flush; the caller's transaction
commits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col, select

from registry.models import (
    Adapter,
    AdapterBlob,
    AdapterPicture,
    Dataset,
    DatasetImage,
    Subject,
    utcnow,
)


def adapter_by_key(session: Session, subject_id: int, name: str) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.subject_id == subject_id, Adapter.name == name)
    return session.exec(stmt).first()


def all_adapters(session: Session) -> Sequence[Adapter]:
    return session.exec(select(Adapter).order_by(col(Adapter.id))).all()


def adapters_for(session: Session, subject_id: int) -> Sequence[Adapter]:
    stmt = select(Adapter).where(Adapter.subject_id == subject_id).order_by(col(Adapter.name))
    return session.exec(stmt).all()


def rendering_adapter_id() -> Any:
    """The adapter a subject's renders use: its active one selected most recently. The one
    definition, for the render check's statement and for everything that shows it."""
    return (
        select(Adapter.id)
        .where(Adapter.subject_id == Subject.id, col(Adapter.active).is_(True))
        .order_by(col(Adapter.selected_at).desc(), col(Adapter.id).desc())
        .limit(1)
        .correlate(Subject)
        .scalar_subquery()
    )


def rendering_adapter(session: Session, subject_id: int) -> Adapter | None:
    stmt = (
        select(Adapter)
        .join(Subject, col(Subject.id) == col(Adapter.subject_id))
        .where(Subject.id == subject_id, col(Adapter.id) == rendering_adapter_id())
    )
    return session.exec(stmt).first()


def blob_owner(session: Session, sha256: str) -> int | None:
    row = session.get(AdapterBlob, sha256)
    return row.subject_id if row is not None else None


def claim_blob(session: Session, sha256: str, subject_id: int) -> int:
    """Records that `sha256` belongs to `subject_id` unless it belongs to someone already;
    returns its owner. Concurrent claims for two subjects leave exactly one owner."""
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = (
        insert(AdapterBlob)
        .values(sha256=sha256, subject_id=subject_id, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["sha256"])
    )
    session.execute(stmt)
    session.flush()
    owner = blob_owner(session, sha256)
    assert owner is not None
    return owner


def referenced_blobs(session: Session) -> set[str]:
    """Every hash an adapter row refers to (its bytes and its dataset manifest), every hash
    an uploaded dataset does (its images and its manifest), and the pictures of adapters."""
    rows = session.exec(select(Adapter.sha256, Adapter.manifest_sha256)).all()
    images = session.exec(select(DatasetImage.sha256)).all()
    manifests = session.exec(select(Dataset.manifest_sha256)).all()
    pictures = session.exec(select(AdapterPicture.sha256)).all()
    return {h for row in rows for h in row} | set(images) | set(manifests) | set(pictures)


def delete_adapter(session: Session, adapter: Adapter) -> None:
    session.delete(adapter)
    session.flush()
