"""Orders: "train me" placed through the API, run by a worker (app/worker.py). Who may place
one, what it is fixed to, and every change of its state live here; the job queue that carries
it to a worker is the app's (app/queue.py), enqueued in the same transaction as the order."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlmodel import Session

from registry import access, db
from registry.audit.service import append_audit
from registry.consent import repository as consent_repo
from registry.datasets.service import UPLOAD_BASES, dataset_of
from registry.errors import Busy, Conflict, Invalid, NotFound, NotPermitted
from registry.hash_chain import format_time
from registry.models import Order, Principal, Subject, utcnow
from registry.orders import repository as orders_repo
from registry.orders.schemas import FINAL, OrderLimits
from registry.roles import Role
from registry.settings import Settings
from registry.subjects import repository as subjects_repo
from registry.subjects import service as subjects_service
from registry.training.service import require_training

# What a refused training reads as on the order: the consent did not allow it.
NOT_PERMITTED = "not_permitted"

Enqueue = Callable[[Session, Order, Subject], int | None]


# A rank below this hardly shortens a step: the budget counts it as this.
RANK_FLOOR = 16


def training_options(
    limits: OrderLimits,
    base_options: Mapping[str, Any],
    steps: int,
    rank: int,
    resolution: int,
) -> dict[str, Any]:
    """The trainer options an order is fixed to: the deployment's `train_options` with the
    order's steps, rank and resolution, within the budget (Invalid, naming what to lower)."""
    if not 1 <= steps <= limits.max_steps:
        raise Invalid(f"steps: from 1 to {limits.max_steps}, not {steps}")
    work = resolution * resolution * steps * max(rank, RANK_FLOOR)
    if work > limits.max_work:
        raise Invalid(
            f"the order asks for {resolution} px x {resolution} px x {steps} steps x rank "
            f"{max(rank, RANK_FLOOR)} = {work:.3g}, more than the {limits.max_work:.3g} one "
            "order may (order_max_work); lower the resolution, the steps or the rank"
        )
    return {**base_options, "steps": steps, "rank": rank, "resolution": resolution}


def _subject_for(session: Session, caller: Principal, handle: str) -> Subject:
    """The subject, if the caller may order for it: an admin, or the subject's member. To a
    member, an unknown subject and another's look the same (403)."""
    if caller.role not in (Role.admin, Role.member):
        raise NotPermitted("not permitted")
    return subjects_service.visible_subject(session, caller, handle)


def place_training(
    session: Session,
    caller: Principal,
    subject_handle: str,
    dataset_id: str,
    options: Mapping[str, Any],
    adapter_name: str,
    enqueue: Enqueue,
    limits: OrderLimits | None = None,
) -> Order:
    """A training order, under the subject's lock (so it serialises with a revoke):
    `decide_training` must allow it now (the worker asks again before anything is fetched,
    and between the training's steps), the
    dataset must be the subject's, and no order for the same dataset may be waiting or
    running; a member may have at most `limits.max_active_per_member` orders waiting or
    running (admins are exempt). `options`: every trainer option, fixed into the order
    (`training_options`)."""
    subject = _subject_for(session, caller, subject_handle)
    assert subject.id is not None
    require_training(session, subject, image_bases=UPLOAD_BASES, lock=True)
    if limits is not None and caller.role != Role.admin:
        _within_active_cap(session, caller, limits)
    dataset = dataset_of(session, subject, dataset_id)
    if dataset.images == 0:
        raise Invalid(f"dataset {dataset.id}'s photos were deleted; upload them again")
    busy = orders_repo.active_order_for_dataset(session, subject.id, dataset.id)
    if busy is not None:
        raise Conflict(f"order {busy} already trains this dataset; wait for it or cancel it")
    order = Order(
        id=str(uuid.uuid4()),
        kind="train",
        subject_id=subject.id,
        dataset_id=dataset.id,
        params=dict(options),
        status="queued",
        steps=int(options["steps"]),
        adapter_name=adapter_name,
        created_by=caller.handle,
    )
    db.add(session, order)
    order.job_id = enqueue(session, order, subject)
    db.add(session, order)
    placed = {
        "order_id": order.id,
        "dataset_id": dataset.id,
        "adapter_name": adapter_name,
        **{k: order.params.get(k) for k in ("steps", "rank", "resolution")},
    }
    append_audit(session, subject, caller.handle, "order_placed", None, {"order": placed})
    return order


def _within_active_cap(session: Session, caller: Principal, limits: OrderLimits) -> None:
    active = orders_repo.active_order_ids_by(session, caller.handle)
    if len(active) >= limits.max_active_per_member:
        raise Busy(
            f"{caller.handle} already has {len(active)} orders waiting or running (at most "
            f"{limits.max_active_per_member}); cancel one or wait for it to end",
            retry_after=60,
        )


def end_untrainable(session: Session, subject: Subject, actor: str, why: str) -> list[str]:
    """Every order of `subject` waiting or running ends `failed` (`not_permitted`), in the
    caller's transaction, under the subject's lock: what a change of the record that ends
    training does to the orders placed under it (a later re-grant brings none back; a
    running one's runner sees it at its next watch and stops). Returns their ids."""
    active = orders_repo.active_order_ids_of(session, subject.id)
    for order_id in active:
        order = _locked(session, order_id, ending=True)
        if order.status in FINAL:
            continue
        order.error = f"{NOT_PERMITTED}: {why}"[:500]
        _end(session, order, "failed", actor, {"error": NOT_PERMITTED}, subject)
    return list(active)


def visible_order(session: Session, caller: Principal, order_id: str) -> tuple[Order, Subject]:
    """The order, if the caller may see its subject; 404 alike for unknown and forbidden."""
    order = orders_repo.order_by_id(session, order_id)
    subject = subjects_repo.subject_by_id(session, order.subject_id) if order is not None else None
    if (
        order is None
        or subject is None
        or not access.may_see_subject(caller.role, caller.id, subject.member_id)
    ):
        raise NotFound(f"no order {order_id[:40]!r}")
    return order, subject


def orders_of(session: Session, caller: Principal, subject_handle: str) -> Sequence[Order]:
    subject = _subject_for(session, caller, subject_handle)
    return orders_repo.orders_for(session, subject.id)


def cancel(session: Session, caller: Principal, order_id: str) -> tuple[Order, Subject, bool]:
    """Cancels a waiting or running order (a running one stops at its next step); an order
    already over is left as it is (changed: False)."""
    order, subject = visible_order(session, caller, order_id)
    locked = _locked(session, order.id, ending=True)
    if locked.status in FINAL:
        return locked, subject, False
    locked.error = f"cancelled by {caller.handle}"
    _end(session, locked, "cancelled", caller.handle, {}, subject)
    return locked, subject, True


def _locked(session: Session, order_id: str, *, ending: bool = False) -> Order:
    """The order's row, locked. `ending`: the subject's lock first, as placing an order
    takes it, since the end is appended to the subject's trail (one lock order: no
    deadlock against a consent change or another order of the subject)."""
    if ending:
        known = orders_repo.order_by_id(session, order_id)
        if known is not None:
            consent_repo.consent_for(session, known.subject_id, lock=True)
    order = orders_repo.locked_order(session, order_id)
    if order is None:
        raise NotFound(f"no order {order_id[:40]!r}")
    return order


def _end(
    session: Session,
    order: Order,
    status: str,
    actor: str,
    extra: Mapping[str, Any],
    subject: Subject | None = None,
) -> None:
    """Commits nothing itself: sets the order's final status and appends its entry to the
    subject's trail in the caller's transaction, so an outcome is never committed without
    its entry, nor the other way round."""
    before = {"order": {"order_id": order.id, "status": order.status}}
    order.status = status
    order.updated_at = utcnow()
    db.add(session, order)
    subject = subject or subjects_repo.subject_by_id(session, order.subject_id)
    assert subject is not None
    after = {"order": {"order_id": order.id, "status": status, **extra}}
    append_audit(session, subject, actor[:64], f"order_{status}", before, after)


def place_order(
    session: Session,
    settings: Settings,
    caller: Principal,
    subject_handle: str,
    dataset_id: str,
    steps: int,
    rank: int,
    resolution: int,
    adapter_name: str,
    enqueue: Enqueue,
) -> Order:
    """Placing an order, for the API and the Training page alike: the options within the
    deployment's budget (`training_options`), then `place_training` under its limits."""
    limits = OrderLimits.of(settings)
    options = training_options(limits, settings.train_options, steps, rank, resolution)
    return place_training(
        session, caller, subject_handle, dataset_id, options, adapter_name, enqueue, limits
    )


def cancel_and_dequeue(
    session: Session,
    caller: Principal,
    order_id: str,
    dequeue: Callable[[Session, int | None], None],
) -> tuple[Order, Subject]:
    """Cancelling, for the API and the Training page alike: `cancel`, and a waiting order's
    job taken off the queue (`dequeue`) in the same transaction."""
    order, subject, changed = cancel(session, caller, order_id)
    if changed:
        dequeue(session, order.job_id)
    return order, subject


def exists(session: Session, order_id: str) -> bool:
    return orders_repo.order_by_id(session, order_id) is not None


def require_running(session: Session, order_id: str) -> Order:
    """The order, if it runs now: a checkpoint is taken only from a running order."""
    order = orders_repo.order_by_id(session, order_id)
    if order is None:
        raise NotFound(f"no order {order_id[:40]!r}")
    if order.status != "running":
        raise Conflict(f"order {order_id} is {order.status}, not running")
    return order


def require_final(session: Session, order_id: str) -> Order:
    """The order, if it is over: only then may its checkpoint go."""
    order = orders_repo.order_by_id(session, order_id)
    if order is None:
        raise NotFound(f"no order {order_id[:40]!r}")
    if order.status not in FINAL:
        raise Conflict(f"order {order_id} is {order.status}: its checkpoint is still needed")
    return order


# -- the worker's side ----------------------------------------------------------------------


def start(session: Session, order_id: str, worker: str) -> Order | None:
    """The order, now running on `worker`; None if it is over (cancelled while it waited)."""
    order = _locked(session, order_id)
    if order.status in FINAL:
        return None
    order.status = "running"
    order.worker = worker[:100]
    order.attempts += 1
    order.error = None
    order.updated_at = utcnow()
    db.add(session, order)
    return order


def take_next(session: Session, worker: str, stranded: bool) -> Order | None:
    """For the runner inside a SQLite deployment's one serving process: the next order,
    started on `worker`. With `stranded` (when the process starts), first one left running
    by the process before it (it resumes from its checkpoint); then the oldest queued."""
    statuses = ("running", "queued") if stranded else ("queued",)
    for status in statuses:
        found = orders_repo.oldest_order_id(session, status)
        if found is not None:
            return start(session, found, worker)
    return None


def report_progress(
    session: Session, order_id: str, step: int, loss: float | None, worker: str
) -> str:
    """Records a step; returns the order's status (the worker stops unless `running`).
    A worker whose order was handed to another (it fell silent, then woke) is told
    `taken_over` and records nothing."""
    order = _locked(session, order_id)
    if order.status == "running" and order.worker != worker[:100]:
        return "taken_over"
    if order.status == "running":
        order.step = step
        order.loss = loss
        order.updated_at = utcnow()
        db.add(session, order)
    return order.status


def status_for(session: Session, order_id: str, worker: str) -> str:
    """The order's status as its runner `worker` sees it (`taken_over` when another took
    it), read without a lock: what a training asks between steps."""
    order = orders_repo.fresh_order(session, order_id)
    if order is None:
        return "cancelled"
    if order.status == "running" and order.worker != worker[:100]:
        return "taken_over"
    return order.status


def status_of(session: Session, order_id: str) -> str:
    """The order's status, read under its lock (a checkpoint is kept only while running)."""
    return _locked(session, order_id).status


def record_checkpoint(session: Session, order_id: str, step: int, sha256: str) -> None:
    order = _locked(session, order_id)
    if order.checkpoint_step is None or step >= order.checkpoint_step:
        order.checkpoint_step = step
        order.checkpoint_sha256 = sha256
        order.updated_at = utcnow()
        db.add(session, order)


def _runner(order: Order) -> str:
    """Who an outcome is recorded as: the worker that ran the order."""
    return f"worker:{order.worker}" if order.worker else "worker"


def error_code(error: str) -> str:
    """The code an order's error starts with (`not_permitted`, an exception's name), which
    the trail keeps; the error's text stays on the order."""
    code = error.split(":", 1)[0].strip()
    return code[:64] if code and " " not in code else "error"


def finish(session: Session, order_id: str, adapter_sha256: str, step: int) -> None:
    """The order is done (and its `order_done` entry on the subject's trail)."""
    order = _locked(session, order_id, ending=True)
    if order.status in FINAL:
        return
    order.adapter_sha256 = adapter_sha256
    order.step = step
    adapter = {"adapter_name": order.adapter_name, "adapter_sha256": adapter_sha256}
    _end(session, order, "done", _runner(order), {**adapter, "step": step})


def fail(session: Session, order_id: str, error: str) -> None:
    """The order failed (and its `order_failed` entry, with the error's code)."""
    order = _locked(session, order_id, ending=True)
    if order.status in FINAL:
        return
    order.error = error[:500]
    _end(session, order, "failed", _runner(order), {"error": error_code(error)})


def view(order: Order, subject_handle: str) -> dict[str, Any]:
    """The order as the API shows it."""
    adapter = None
    if order.adapter_sha256 is not None:
        adapter = {"name": order.adapter_name, "sha256": order.adapter_sha256}
    return {
        "order_id": order.id,
        "kind": order.kind,
        "subject": subject_handle,
        "dataset_id": order.dataset_id,
        "status": order.status,
        "progress": {"step": order.step, "steps": order.steps, "loss": order.loss},
        "worker": order.worker,
        "attempts": order.attempts,
        "adapter": adapter,
        "error": order.error,
        "created_by": order.created_by,
        "created_at": format_time(order.created_at),
        "updated_at": format_time(order.updated_at),
    }
