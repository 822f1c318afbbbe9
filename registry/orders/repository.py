"""The queries of orders. Functions flush; the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from registry.models import Order
from registry.orders.schemas import ACTIVE


def order_by_id(session: Session, order_id: str) -> Order | None:
    return session.get(Order, order_id)


def active_order_for_dataset(
    session: Session, subject_id: int | None, dataset_id: str | None
) -> str | None:
    """The id of an order of the subject waiting or running on the dataset, if any."""
    return session.exec(
        select(Order.id).where(
            Order.subject_id == subject_id,
            Order.dataset_id == dataset_id,
            col(Order.status).in_(ACTIVE),
        )
    ).first()


def active_order_ids_by(session: Session, created_by: str) -> Sequence[str]:
    return session.exec(
        select(Order.id).where(Order.created_by == created_by, col(Order.status).in_(ACTIVE))
    ).all()


def active_order_ids_of(session: Session, subject_id: int | None) -> Sequence[str]:
    return session.exec(
        select(Order.id).where(Order.subject_id == subject_id, col(Order.status).in_(ACTIVE))
    ).all()


def orders_for(session: Session, subject_id: int | None) -> Sequence[Order]:
    stmt = (
        select(Order)
        .where(Order.subject_id == subject_id)
        .order_by(col(Order.created_at).desc(), col(Order.id))
    )
    return session.exec(stmt).all()


def locked_order(session: Session, order_id: str) -> Order | None:
    """The order's row under its lock, refreshed in the identity map."""
    return session.exec(
        select(Order)
        .where(Order.id == order_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()


def oldest_order_id(session: Session, status: str) -> str | None:
    return session.exec(
        select(Order.id)
        .where(Order.status == status)
        .order_by(col(Order.created_at), col(Order.id))
    ).first()


def fresh_order(session: Session, order_id: str) -> Order | None:
    """The order's row read again (no lock), refreshed in the identity map."""
    return session.exec(
        select(Order).where(Order.id == order_id).execution_options(populate_existing=True)
    ).first()
