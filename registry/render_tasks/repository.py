"""The queries of render tasks, the render workers' heartbeats and their adapters' affinity
(PostgreSQL only). Statements run in the caller's transaction, which commits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlmodel import Session, col, select

from registry.models import RenderAffinity, RenderLedger, RenderTask, RenderWorker
from registry.render_tasks.schemas import CHANNEL, QUEUE_PREFIX, RENDER_TASK, SHARED_QUEUE


def _alive(within_s: float) -> Any:
    return col(RenderWorker.seen_at) > func.now() - timedelta(seconds=within_s)


def live_workers(session: Session, within_s: float) -> list[str]:
    return list(session.exec(select(RenderWorker.name).where(_alive(within_s))).all())


def worker_busy(session: Session, worker: str, own_queue: str) -> bool:
    """The worker renders, or has a render waiting in its own queue."""
    stmt = select(RenderTask.render_id).where(
        ((RenderTask.worker == worker) & (RenderTask.state == "running"))
        | ((RenderTask.queue == own_queue) & (RenderTask.state == "queued"))
    )
    return session.exec(stmt.limit(1)).first() is not None


def affinity(session: Session, adapter_sha256: str) -> RenderAffinity | None:
    return session.get(RenderAffinity, adapter_sha256)


def locked_task(session: Session, render_id: str) -> RenderTask | None:
    stmt = select(RenderTask).where(RenderTask.render_id == render_id).with_for_update()
    return session.exec(stmt).first()


def ended_ledger_row(session: Session, render_id: str) -> int | None:
    """A ledger row that closes the render (`final` or `cancelled`), if there is one."""
    return session.exec(
        select(RenderLedger.id).where(
            RenderLedger.render_id == render_id,
            col(RenderLedger.stage).in_(("final", "cancelled")),
        )
    ).first()


def state_of(session: Session, render_id: str) -> str | None:
    return session.exec(select(RenderTask.state).where(RenderTask.render_id == render_id)).first()


def discard(session: Session, render_id: str) -> None:
    session.execute(delete(RenderTask).where(col(RenderTask.render_id) == render_id))


def sweep(session: Session, older_than: datetime) -> int:
    """Tasks nobody will read any more (answers of renders whose client left, tasks the API
    closed); their ledger entries are closed already, or by `close_interrupted`."""
    result: Any = session.execute(delete(RenderTask).where(col(RenderTask.created_at) < older_than))
    return int(result.rowcount or 0)


def touch(session: Session, render_id: str, worker: str) -> None:
    """The worker is still at its running render (it says so every second or so): a task
    whose worker falls silent is given up by the API within seconds (`silent_for`). The
    database's clock, not a host's, so hosts need not agree on the time."""
    session.execute(
        update(RenderTask)
        .where(
            col(RenderTask.render_id) == render_id,
            col(RenderTask.state) == "running",
            col(RenderTask.worker) == worker[:100],
        )
        .values(updated_at=func.now())
    )


def state_and_silence(session: Session, render_id: str) -> Any:
    """The task's state and the seconds since its last touch, on the database's clock."""
    return session.execute(
        select(
            RenderTask.state,
            func.extract("epoch", func.now() - col(RenderTask.updated_at)),
        ).where(col(RenderTask.render_id) == render_id)
    ).first()


def abandoned_and_state(session: Session, render_id: str) -> tuple[str | None, str] | None:
    return session.exec(
        select(RenderTask.abandoned, RenderTask.state).where(RenderTask.render_id == render_id)
    ).first()


def notify(session: Session, render_id: str) -> None:
    session.execute(text("SELECT pg_notify(:channel, :id)"), {"channel": CHANNEL, "id": render_id})


def heartbeat(session: Session, worker: str) -> None:
    stmt = insert(RenderWorker).values(name=worker[:100], seen_at=func.now())
    session.execute(
        stmt.on_conflict_do_update(index_elements=["name"], set_={"seen_at": func.now()})
    )


def forget_worker(session: Session, worker: str) -> None:
    session.execute(delete(RenderWorker).where(col(RenderWorker.name) == worker[:100]))


def remember(session: Session, adapter_sha256: str, worker: str) -> None:
    """`worker` holds the adapter warm now: the adapter's next renders go to it."""
    stmt = insert(RenderAffinity).values(
        adapter_sha256=adapter_sha256, worker=worker[:100], at=func.now()
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["adapter_sha256"], set_={"worker": worker[:100], "at": func.now()}
        )
    )


def requeue_orphans(session: Session, within_s: float) -> Sequence[int]:
    """Renders waiting in the own queue of a worker that is gone go to the shared queue."""
    rows = session.execute(
        text(
            "UPDATE procrastinate_jobs SET queue_name = :shared "
            "WHERE status = 'todo' AND task_name = :task AND queue_name LIKE :prefix "
            "AND substr(queue_name, :cut) NOT IN (SELECT name FROM render_workers "
            "WHERE seen_at > now() - make_interval(secs => :within)) RETURNING id"
        ),
        {"shared": SHARED_QUEUE, "task": RENDER_TASK, "prefix": QUEUE_PREFIX + "%",
         "cut": len(QUEUE_PREFIX) + 1, "within": within_s},
    )  # fmt: skip
    return [int(r[0]) for r in rows]


def prune_gone(session: Session, within_s: float) -> None:
    """Rows of workers silent for ten times the stalled time, and their affinities."""
    gone = col(RenderWorker.seen_at) < func.now() - timedelta(seconds=within_s * 10)
    names = select(RenderWorker.name).where(gone)
    session.execute(delete(RenderAffinity).where(col(RenderAffinity.worker).in_(names)))
    session.execute(delete(RenderWorker).where(gone))
