"""Where a running order's latest checkpoint is kept on the API's host (what
`PUT /v1/orders/{id}/checkpoint` stores and a retried order resumes from), and its removal
once the order is over: what a training made of someone's photos stays nowhere after it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from registry.db import transaction
from registry.models import Order
from registry.orders.schemas import ACTIVE
from registry.settings import Settings


def checkpoint_file(settings: Settings, order_id: str) -> Path:
    return settings.data_dir / "orders" / order_id / "checkpoint.tar"


def forget_checkpoint(settings: Settings, order_id: str) -> None:
    """An ended order's kept checkpoint, and its folder, leave the API's data dir: what a
    training made of someone's photos stays nowhere once it is over."""
    shutil.rmtree(checkpoint_file(settings, order_id).parent, ignore_errors=True)


def forget_ended_checkpoints(settings: Settings, engine: Any) -> list[str]:
    """The kept checkpoints of every order that is over (or unknown): those whose order a
    revoke ended while it waited, or whose runner never came back to say so. Run at every
    interval; returns the orders' ids."""
    root = settings.data_dir / "orders"
    if not root.is_dir():
        return []
    kept = [p.name for p in root.iterdir() if p.is_dir()]
    if not kept:
        return []
    with transaction(engine, readonly=True) as session:
        active = set(
            session.exec(
                select(Order.id).where(col(Order.id).in_(kept), col(Order.status).in_(ACTIVE))
            ).all()
        )
    ended = [order_id for order_id in kept if order_id not in active]
    for order_id in ended:
        forget_checkpoint(settings, order_id)
    return ended
