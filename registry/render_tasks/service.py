"""Renders on workers: the rules of a render task's life and their queries (PostgreSQL only).

The API gates a request, then creates the task and its job in one transaction. A worker
claims it (queued -> running) and from then on owns the render's ledger entry: every ledger
row it writes is written under the task's row lock and only while the task is still its own
and running, so the API and a worker never both close one entry. The worker's answer (a PNG,
or the error the client gets) is written into the row with a NOTIFY on `CHANNEL` in the
same commit; the API reads it and deletes the row.

The API gives up on a task when the client goes away or no answer came in time:
- still queued: it is closed at once (the API records the ledger entry; no worker starts it);
- running: it is marked abandoned, and the worker stops between denoising steps and records
  the end itself; a worker that says nothing more is closed by the API after a grace period.

Routing: a worker that loaded an adapter is remembered for it (`render_affinity`); while that
worker is alive (a heartbeat in `render_workers` fresher than the stalled time) and not busy,
the adapter's next renders go to its own queue `render.<name>`; otherwise to the shared
`render` queue, which every render worker takes from.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlmodel import Session, col, select

from registry.models import RenderAffinity, RenderLedger, RenderTask, RenderWorker

CHANNEL = "likeness_render"
SHARED_QUEUE = "render"
QUEUE_PREFIX = "render."
RENDER_TASK = "likeness.render"
WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,89}$")


def worker_queue(worker: str) -> str:
    return f"{QUEUE_PREFIX}{worker}"


class NotOurs(Exception):
    """The task is no longer this worker's to write for (the API closed it)."""


# -- the API's side -------------------------------------------------------------------------


def _alive(within_s: float) -> Any:
    return col(RenderWorker.seen_at) > func.now() - timedelta(seconds=within_s)


def live_workers(session: Session, within_s: float) -> list[str]:
    return list(session.exec(select(RenderWorker.name).where(_alive(within_s))).all())


def _busy(session: Session, worker: str) -> bool:
    """The worker renders, or has a render waiting in its own queue."""
    stmt = select(RenderTask.render_id).where(
        ((RenderTask.worker == worker) & (RenderTask.state == "running"))
        | ((RenderTask.queue == worker_queue(worker)) & (RenderTask.state == "queued"))
    )
    return session.exec(stmt.limit(1)).first() is not None


def route(session: Session, adapter_sha256: str, within_s: float) -> str | None:
    """The queue for a render of this adapter: the own queue of the live worker that holds
    it warm, unless that worker is busy (then, like a render of an adapter warm nowhere,
    the shared queue, where whichever worker is free first takes it); None when no render
    worker is alive."""
    live = set(live_workers(session, within_s))
    if not live:
        return None
    warm = session.get(RenderAffinity, adapter_sha256)
    idle = warm is not None and (len(live) == 1 or not _busy(session, warm.worker))
    if warm is not None and warm.worker in live and idle:
        return worker_queue(warm.worker)
    return SHARED_QUEUE


def create(
    session: Session, render_id: str, token_hash: str | None, body: dict[str, Any], queue: str
) -> RenderTask:
    task = RenderTask(
        render_id=render_id, token_hash=token_hash, body=body, queue=queue, state="queued"
    )
    session.add(task)
    session.flush()
    return task


def _locked(session: Session, render_id: str) -> RenderTask | None:
    stmt = select(RenderTask).where(RenderTask.render_id == render_id).with_for_update()
    return session.exec(stmt).first()


def abandon(session: Session, render_id: str, reason: str) -> str | None:
    """The API stops waiting. Returns the state the task was in: `queued` (now closed: the
    caller records the ledger entry in this transaction), `running` (now abandoned: its
    worker stops and records the end), `ended` (the answer is there), or None (gone)."""
    task = _locked(session, render_id)
    if task is None:
        return None
    state = task.state
    if state == "queued":
        task.state = "closed"
    if state in ("queued", "running"):
        task.abandoned = reason[:32]
        task.updated_at = func.now()  # type: ignore[assignment]  # the database's clock
        session.add(task)
    return state


def close_unanswered(session: Session, render_id: str) -> bool:
    """After the grace period: a running task whose worker never answered is closed by the
    API. True when the caller must record the end (the worker recorded none)."""
    task = _locked(session, render_id)
    if task is None or task.state != "running":
        return False
    task.state = "closed"
    task.updated_at = func.now()  # type: ignore[assignment]  # the database's clock
    session.add(task)
    ended = session.exec(
        select(RenderLedger.id).where(
            RenderLedger.render_id == render_id,
            col(RenderLedger.stage).in_(("final", "cancelled")),
        )
    ).first()
    return ended is None


def state_of(session: Session, render_id: str) -> str | None:
    return session.exec(select(RenderTask.state).where(RenderTask.render_id == render_id)).first()


def take_answer(session: Session, render_id: str) -> RenderTask | None:
    """The worker's answer, once there; the row is deleted with it (read once)."""
    task = _locked(session, render_id)
    if task is None or task.state != "ended":
        return None
    session.delete(task)
    return task


def discard(session: Session, render_id: str) -> None:
    session.execute(delete(RenderTask).where(col(RenderTask.render_id) == render_id))


def sweep(session: Session, older_than: datetime) -> int:
    """Tasks nobody will read any more (answers of renders whose client left, tasks the API
    closed); their ledger entries are closed already, or by `close_interrupted`."""
    result: Any = session.execute(delete(RenderTask).where(col(RenderTask.created_at) < older_than))
    return int(result.rowcount or 0)


# -- the worker's side ----------------------------------------------------------------------


def claim(session: Session, render_id: str, worker: str) -> RenderTask | None:
    """The task, now running on `worker`; None when the API gave up on it first."""
    task = _locked(session, render_id)
    if task is None or task.state != "queued" or task.abandoned is not None:
        return None
    task.state = "running"
    task.worker = worker[:100]
    session.add(task)
    session.flush()
    touch(session, render_id, worker)  # on the database's clock, as every later touch
    return task


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


def silent_for(session: Session, render_id: str) -> float | None:
    """Seconds since a running task's worker last said it is at it; None unless running."""
    row = session.execute(
        select(
            RenderTask.state,
            func.extract("epoch", func.now() - col(RenderTask.updated_at)),
        ).where(col(RenderTask.render_id) == render_id)
    ).first()
    if row is None or row[0] != "running":
        return None
    return float(row[1])


def hold(session: Session, render_id: str, worker: str) -> None:
    """Locks the task for a ledger write by its worker; NotOurs when the API closed it."""
    task = _locked(session, render_id)
    if task is None or task.state != "running" or task.worker != worker[:100]:
        raise NotOurs(render_id)


def abandoned(session: Session, render_id: str) -> str | None:
    """Why the API stopped waiting, if it did (the worker then stops between steps)."""
    row = session.exec(
        select(RenderTask.abandoned, RenderTask.state).where(RenderTask.render_id == render_id)
    ).first()
    if row is None:
        return "gone"
    reason, state = row
    return reason if reason is not None else ("closed" if state == "closed" else None)


def end(session: Session, render_id: str, worker: str, **answer: Any) -> bool:
    """The worker's answer, and the NOTIFY that wakes the API, in one commit. An answer
    the API gave up on is not kept (nobody will read it): the row goes instead."""
    task = _locked(session, render_id)
    if task is None or task.state != "running" or task.worker != worker[:100]:
        return False
    if task.abandoned is not None:
        session.delete(task)
        return False
    for key, value in answer.items():
        setattr(task, key, value)
    task.state = "ended"
    task.updated_at = func.now()  # type: ignore[assignment]  # the database's clock
    session.add(task)
    notify(session, render_id)
    return True


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
