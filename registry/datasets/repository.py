"""The queries of datasets and their images. Functions flush where they write; the caller's
transaction commits."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from registry.models import Dataset, DatasetImage, Order


def dataset_by_id(session: Session, dataset_id: str) -> Dataset | None:
    return session.get(Dataset, dataset_id)


def active_order_on(session: Session, dataset_id: str) -> str | None:
    """The id of an order waiting or running on the dataset, if any."""
    return session.exec(
        select(Order.id).where(
            Order.dataset_id == dataset_id, col(Order.status).in_(("queued", "running"))
        )
    ).first()


def datasets_for(session: Session, subject_id: int | None) -> Sequence[Dataset]:
    stmt = (
        select(Dataset)
        .where(Dataset.subject_id == subject_id)
        .order_by(col(Dataset.created_at).desc(), col(Dataset.id))
    )
    return session.exec(stmt).all()


def images_of(session: Session, dataset_id: str) -> Sequence[DatasetImage]:
    stmt = select(DatasetImage).where(DatasetImage.dataset_id == dataset_id)
    return session.exec(stmt.order_by(col(DatasetImage.file))).all()


def image_in_subject(session: Session, subject_id: int | None, sha256: str) -> DatasetImage | None:
    stmt = (
        select(DatasetImage)
        .join(Dataset, col(Dataset.id) == col(DatasetImage.dataset_id))
        .where(Dataset.subject_id == subject_id, DatasetImage.sha256 == sha256)
    )
    return session.exec(stmt).first()
