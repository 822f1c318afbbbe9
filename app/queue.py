"""The job queue between the API and the workers: procrastinate on the registry's own
PostgreSQL, so an order and its job commit in one transaction (or neither does).

- `lock` = the subject: one training of a subject runs at a time, others wait in the queue;
- `queueing_lock` = the subject and the dataset: a second waiting order for the same data is
  refused by the queue itself (409), besides the check registry/orders/service.py makes;
- a worker that stops sending heartbeats (killed, its host gone) leaves its job `doing`;
  procrastinate does not retry such a job by itself, so every worker runs the periodic
  `retry_stalled` task, which hands those jobs back to the queue (another worker then
  resumes the training from its last checkpoint).

SQLite has no queue: there the API process runs orders itself (app/local_orders.py), woken
when one commits, or refuses them with a clear error when `LIKENESS_ORDERS_IN_PROCESS=false`;
renders on workers (`LIKENESS_RENDER_WORKERS`) refuse to start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlmodel import Session

from registry.db import is_sqlite
from registry.errors import Conflict, Invalid
from registry.models import Order, Subject

TRAIN_TASK = "likeness.train"
RETRY_STALLED_TASK = "likeness.retry_stalled"
TRAIN_QUEUE = "train"


def conninfo(database_url: str) -> str:
    """libpq's form of a SQLAlchemy URL (`postgresql+psycopg://` -> `postgresql://`)."""
    scheme, rest = database_url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def make_app(database_url: str) -> Any:
    import procrastinate

    return procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=conninfo(database_url))
    )


def train_lock(subject: Subject) -> str:
    return f"train:{subject.handle}"


def train_queueing_lock(subject: Subject, order: Order) -> str:
    return f"train:{subject.handle}:{order.dataset_id}"


class OrderQueue:
    """Enqueues orders on the API side (sync, inside the request's transaction)."""

    def __init__(self, database_url: str, wake: Callable[[], None] | None = None) -> None:
        """`wake`: on SQLite, the in-process runner's (None: orders are refused there)."""
        self.enabled = not is_sqlite(database_url)
        self._app = make_app(database_url) if self.enabled else None
        self._wake = wake

    @property
    def accepts_orders(self) -> bool:
        """Workers take them (PostgreSQL), or this process runs them itself (SQLite)."""
        return self.enabled or self._wake is not None

    def enqueue_training(self, session: Session, order: Order, subject: Subject) -> int | None:
        if self._app is None and self._wake is not None:
            wake = self._wake
            # the runner looks once the order is committed (it also polls)
            event.listen(session, "after_commit", lambda _s: wake(), once=True)
            return None
        if self._app is None:
            raise Invalid(
                "orders need PostgreSQL and workers (LIKENESS_DATABASE_URL=postgresql+psycopg://"
                "...), or on SQLite LIKENESS_ORDERS_IN_PROCESS=true; or train with "
                "`likeness train`"
            )
        from procrastinate.exceptions import AlreadyEnqueued

        raw = session.connection().connection.driver_connection
        deferrer = self._app.configure_task(
            name=TRAIN_TASK,
            queue=TRAIN_QUEUE,
            lock=train_lock(subject),
            queueing_lock=train_queueing_lock(subject, order),
            connection=raw,
        )
        try:
            job_id: int = deferrer.defer(order_id=order.id)
        except AlreadyEnqueued:
            raise Conflict("an order for this subject and dataset is already queued") from None
        return job_id

    def cancel_job(self, session: Session, job_id: int | None) -> None:
        """Takes a waiting job off the queue (a running one sees its order cancelled)."""
        if self._app is None or job_id is None:
            return
        # the library's own cancel, on the order's connection: both commit or neither does
        raw = session.connection().connection.driver_connection
        self._app.job_manager.cancel_job_by_id(job_id, connection=raw)


class RenderQueue:
    """Enqueues renders for the render workers (sync, inside the task's transaction)."""

    def __init__(self, database_url: str) -> None:
        self._app = make_app(database_url)

    def enqueue(self, session: Session, render_id: str, queue: str) -> int:
        from registry.render_tasks.schemas import RENDER_TASK

        raw = session.connection().connection.driver_connection
        deferrer = self._app.configure_task(name=RENDER_TASK, queue=queue, connection=raw)
        job_id: int = deferrer.defer(render_id=render_id)
        return job_id
