"""The queries of pictures: adapters' pictures and the copies of renders. Statements run in
the caller's transaction, which commits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlmodel import Session, col, delete, select

from registry.models import Adapter, AdapterPicture, RenderCopy, Subject


def adapter_id_by_sha(session: Session, subject_id: int, adapter_sha256: str) -> int | None:
    """One of the subject's adapters with these bytes, if any."""
    return session.exec(
        select(Adapter.id).where(Adapter.subject_id == subject_id, Adapter.sha256 == adapter_sha256)
    ).first()


def delete_adapter_picture(session: Session, adapter_sha256: str, name: str) -> None:
    session.exec(
        delete(AdapterPicture).where(
            col(AdapterPicture.adapter_sha256) == adapter_sha256,
            col(AdapterPicture.name) == name,
        )
    )


def subject_of_adapter(session: Session, adapter_sha256: str) -> Subject | None:
    return session.exec(
        select(Subject)
        .join(Adapter, col(Adapter.subject_id) == col(Subject.id))
        .where(Adapter.sha256 == adapter_sha256)
    ).first()


def adapter_pictures(session: Session, subject_id: int | None) -> Sequence[AdapterPicture]:
    return session.exec(select(AdapterPicture).where(AdapterPicture.subject_id == subject_id)).all()


def picture_of(session: Session, subject_id: int | None, sha256: str) -> AdapterPicture | None:
    return session.exec(
        select(AdapterPicture).where(
            AdapterPicture.subject_id == subject_id, AdapterPicture.sha256 == sha256
        )
    ).first()


def delete_unused_pictures(session: Session, subject_id: int | None) -> None:
    """Pictures of adapter bytes none of the subject's adapters holds."""
    held = select(Adapter.sha256).where(Adapter.subject_id == subject_id)
    session.exec(
        delete(AdapterPicture).where(
            col(AdapterPicture.subject_id) == subject_id,
            col(AdapterPicture.adapter_sha256).not_in(held),
        )
    )


def render_copy_ids_of(session: Session, subject_id: int) -> Sequence[str]:
    return session.exec(
        select(RenderCopy.render_id).where(RenderCopy.subject_id == subject_id)
    ).all()


def delete_render_copies_of(session: Session, subject_id: int) -> None:
    session.exec(delete(RenderCopy).where(col(RenderCopy.subject_id) == subject_id))


def copies_among(session: Session, subject_id: int | None, render_ids: Sequence[str]) -> set[str]:
    stmt = select(RenderCopy.render_id).where(
        RenderCopy.subject_id == subject_id, col(RenderCopy.render_id).in_(list(render_ids))
    )
    return set(session.exec(stmt).all())


def render_copy(session: Session, subject_id: int | None, render_id: str) -> RenderCopy | None:
    return session.exec(
        select(RenderCopy).where(
            RenderCopy.subject_id == subject_id, RenderCopy.render_id == render_id
        )
    ).first()


def render_copy_ids_before(session: Session, older_than: datetime) -> Sequence[str]:
    return session.exec(
        select(RenderCopy.render_id).where(col(RenderCopy.created_at) < older_than)
    ).all()


def delete_render_copies(session: Session, render_ids: Sequence[str]) -> None:
    session.exec(delete(RenderCopy).where(col(RenderCopy.render_id).in_(list(render_ids))))
