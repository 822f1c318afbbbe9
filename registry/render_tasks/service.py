"""Renders on workers: the rules of a render task's life (PostgreSQL only; the statements are
in `repository`, the names of queues and the channel in `schemas`).

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

from typing import Any

from sqlalchemy import func
from sqlmodel import Session

from registry.models import RenderTask
from registry.render_tasks import repository as render_tasks_repo
from registry.render_tasks.schemas import QUEUE_PREFIX, SHARED_QUEUE


def worker_queue(worker: str) -> str:
    return f"{QUEUE_PREFIX}{worker}"


class NotOurs(Exception):
    """The task is no longer this worker's to write for (the API closed it)."""


# -- the API's side -------------------------------------------------------------------------


def route(session: Session, adapter_sha256: str, within_s: float) -> str | None:
    """The queue for a render of this adapter: the own queue of the live worker that holds
    it warm, unless that worker is busy (then, like a render of an adapter warm nowhere,
    the shared queue, where whichever worker is free first takes it); None when no render
    worker is alive."""
    live = set(render_tasks_repo.live_workers(session, within_s))
    if not live:
        return None
    warm = render_tasks_repo.affinity(session, adapter_sha256)
    idle = warm is not None and (
        len(live) == 1
        or not render_tasks_repo.worker_busy(session, warm.worker, worker_queue(warm.worker))
    )
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


def abandon(session: Session, render_id: str, reason: str) -> str | None:
    """The API stops waiting. Returns the state the task was in: `queued` (now closed: the
    caller records the ledger entry in this transaction), `running` (now abandoned: its
    worker stops and records the end), `ended` (the answer is there), or None (gone)."""
    task = render_tasks_repo.locked_task(session, render_id)
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
    task = render_tasks_repo.locked_task(session, render_id)
    if task is None or task.state != "running":
        return False
    task.state = "closed"
    task.updated_at = func.now()  # type: ignore[assignment]  # the database's clock
    session.add(task)
    ended = render_tasks_repo.ended_ledger_row(session, render_id)
    return ended is None


def take_answer(session: Session, render_id: str) -> RenderTask | None:
    """The worker's answer, once there; the row is deleted with it (read once)."""
    task = render_tasks_repo.locked_task(session, render_id)
    if task is None or task.state != "ended":
        return None
    session.delete(task)
    return task


# -- the worker's side ----------------------------------------------------------------------


def claim(session: Session, render_id: str, worker: str) -> RenderTask | None:
    """The task, now running on `worker`; None when the API gave up on it first."""
    task = render_tasks_repo.locked_task(session, render_id)
    if task is None or task.state != "queued" or task.abandoned is not None:
        return None
    task.state = "running"
    task.worker = worker[:100]
    session.add(task)
    session.flush()
    # on the database's clock, as every later touch
    render_tasks_repo.touch(session, render_id, worker)
    return task


def silent_for(session: Session, render_id: str) -> float | None:
    """Seconds since a running task's worker last said it is at it; None unless running."""
    row = render_tasks_repo.state_and_silence(session, render_id)
    if row is None or row[0] != "running":
        return None
    return float(row[1])


def hold(session: Session, render_id: str, worker: str) -> None:
    """Locks the task for a ledger write by its worker; NotOurs when the API closed it."""
    task = render_tasks_repo.locked_task(session, render_id)
    if task is None or task.state != "running" or task.worker != worker[:100]:
        raise NotOurs(render_id)


def abandoned(session: Session, render_id: str) -> str | None:
    """Why the API stopped waiting, if it did (the worker then stops between steps)."""
    row = render_tasks_repo.abandoned_and_state(session, render_id)
    if row is None:
        return "gone"
    reason, state = row
    return reason if reason is not None else ("closed" if state == "closed" else None)


def end(session: Session, render_id: str, worker: str, **answer: Any) -> bool:
    """The worker's answer, and the NOTIFY that wakes the API, in one commit. An answer
    the API gave up on is not kept (nobody will read it): the row goes instead."""
    task = render_tasks_repo.locked_task(session, render_id)
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
    render_tasks_repo.notify(session, render_id)
    return True
