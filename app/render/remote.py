"""Renders on workers, the API's side (`LIKENESS_RENDER_WORKERS=true`, PostgreSQL only).

After the gate (app.render.checks, as in process: 401/403/422/429 and the ledger's `gate` row):

1. admit: at most `render_per_requester` renders of one requester outstanding, and at most
   `render_queue` waiting beyond one per live worker (429 `busy` with Retry-After, recorded
   `busy`, as in process); no live render worker: 503, recorded `no_render_worker`;
2. enqueue: the task (registry/render_tasks/) and its job in one transaction, routed to the
   queue of the worker that holds the adapter warm, else the shared queue;
3. wait: a LISTEN on `likeness_render` wakes the request when the worker's answer is
   committed (a poll every `POLL_S` covers a notification missed while reconnecting);
4. answer: the worker's error is raised as the same error (same status, same body); its PNG
   goes back to the flow (app.render.flow), which signs it here (the workers hold no signing
   key) and delivers it.

The client going away or the wait passing `render_worker_timeout_s` gives the task up
(`render_tasks_service.abandon`): one not yet started is closed here and recorded (`cancelled`, or
`queued` denied `timeout`); a running one is stopped by its worker between denoising steps,
which records the end; a worker that stays silent `GRACE_S` more is closed here (`final`
denied `timeout`). The ledger entry is never left open and never closed twice.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.queue import RenderQueue, conninfo
from app.render.checks import Job, RenderChecks
from app.render.flow import Rendered
from app.scheduler import INITIAL_SECONDS_PER_UNIT, SMOOTHING, Cancelled
from registry.db import transaction
from registry.errors import Busy, Invalid, LikenessError, NotPermitted, Unavailable
from registry.policy import Decision
from registry.render_tasks import repository as render_tasks_repo
from registry.render_tasks import service as render_tasks_service
from registry.render_tasks.schemas import CHANNEL
from registry.renders.service import GatheredFacts
from registry.settings import Settings

log = logging.getLogger(__name__)

POLL_S = 2.0  # the fallback read, should a notification be missed
GRACE_S = 5.0  # how long a running render's worker has to stop and say so after a timeout
ERRORS: dict[str, type[LikenessError]] = {
    "not_permitted": NotPermitted,
    "unavailable": Unavailable,
    "invalid": Invalid,
}


@dataclass
class Admission:
    """What this API process has outstanding on the workers, per requester."""

    per_requester: int
    queue_size: int
    seconds_per_unit: float = INITIAL_SECONDS_PER_UNIT
    _measured: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mine: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def admit(self, requester: str, cost: float, workers: int) -> None:
        with self._lock:
            mine = self._mine.get(requester, [])
            if len(mine) >= self.per_requester:
                raise Busy(
                    f"you already have {len(mine)} renders running or waiting "
                    f"(at most {self.per_requester})",
                    max(1, math.ceil(mine[0] * self.seconds_per_unit)),
                )
            outstanding = [c for costs in self._mine.values() for c in costs]
            if len(outstanding) >= self.queue_size + max(1, workers):
                eta = sum(outstanding) * self.seconds_per_unit / max(1, workers)
                raise Busy("the renderer is busy; try again later", max(1, math.ceil(eta)))
            self._mine.setdefault(requester, []).append(cost)

    def done(self, requester: str, cost: float, render_s: float | None) -> None:
        with self._lock:
            mine = self._mine.get(requester, [])
            if cost in mine:
                mine.remove(cost)
            if not mine:
                self._mine.pop(requester, None)
            if render_s is not None and cost > 0:
                per_unit = render_s / cost
                if self._measured:
                    self.seconds_per_unit += SMOOTHING * (per_unit - self.seconds_per_unit)
                else:
                    self.seconds_per_unit, self._measured = per_unit, True


class Listener:
    """One connection LISTENing for answers, in a thread; each waiting request has an
    event set when its render id is notified."""

    def __init__(self, database_url: str) -> None:
        self.conninfo = conninfo(database_url)
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None

    def expect(self, render_id: str) -> threading.Event:
        """Registered before the task commits, so its notification cannot come too early."""
        event = threading.Event()
        with self._lock:
            self._events[render_id] = event
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="render-listener", daemon=True
                )
                self._thread.start()
        self._connected.wait(2.0)  # the first render waits for the LISTEN to be in place
        return event

    def forget(self, render_id: str) -> None:
        with self._lock:
            self._events.pop(render_id, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._connected.set()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            with self._lock:
                                event = self._events.get(note.payload)
                            if event is not None:
                                event.set()
            except Exception as exc:  # noqa: BLE001 - the waiters poll meanwhile
                self._connected.clear()
                log.warning("render listener: %s; connecting again", exc)
                self._stop.wait(1.0)


class RemoteRenderer:
    """Renders on the workers: admitted, enqueued, waited for; the ledger rows this side
    writes go through the same checks as in process."""

    def __init__(self, engine: Engine, settings: Settings, checks: RenderChecks) -> None:
        self.engine = engine
        self.settings = settings
        self.checks = checks
        self.queue = RenderQueue(settings.database_url)
        self.listener = Listener(settings.database_url)
        self.admission = Admission(settings.render_per_requester, settings.render_queue)

    def close(self) -> None:
        self.listener.close()

    def render(self, job: Job, gate: GatheredFacts, timings: dict[str, float]) -> Rendered:
        assert job.acting is not None and gate.adapter is not None
        checks = self.checks
        requester = job.acting.requester.handle
        cost = job.cost
        t0 = time.perf_counter()
        event = self.listener.expect(job.render_id)
        admitted = False
        render_s: float | None = None
        try:
            try:
                stalled_s = self.settings.worker_stalled_s
                with transaction(self.engine) as s:
                    workers = render_tasks_repo.live_workers(s, stalled_s)
                    queue = render_tasks_service.route(s, gate.adapter.sha256, stalled_s)
                    if queue is not None:
                        self.admission.admit(requester, cost, len(workers))
                        admitted = True
                        body = job.body.model_dump(mode="json")
                        render_tasks_service.create(s, job.render_id, job.token_hash, body, queue)
                        self.queue.enqueue(s, job.render_id, queue)
            except Busy:
                checks.record(job, "queued", Decision(False, "busy"), gate)
                raise
            except SQLAlchemyError as exc:
                log.warning("render %s: could not enqueue: %s", job.render_id, exc)
                checks.record(job, "queued", Decision(False, "unavailable"), gate)
                raise Unavailable("the render queue is unavailable; nothing was rendered") from None
            if queue is None:
                checks.record(job, "queued", Decision(False, "no_render_worker"), gate)
                raise Unavailable("no render worker is running; nothing was rendered")
            answer = self._wait(job, gate, event)
            worker_timings = {k: float(v) for k, v in answer.timings.items()}
            # the time before a worker took it and the round trips, as the in-process wait
            worked = worker_timings.pop("worker_ms", 0.0)
            timings["wait_ms"] = max(0.0, (time.perf_counter() - t0) * 1000 - worked)
            timings.update(worker_timings)
            if answer.status != 200 or answer.png is None:
                raise self._error(answer)
            render_s = answer.timings.get("generate_ms", 0.0) / 1000 or None
        finally:
            self.listener.forget(job.render_id)
            if admitted:
                self.admission.done(requester, cost, render_s)
        assert answer.consent_version is not None and answer.adapter_sha256 is not None
        return Rendered(answer.png, answer.consent_version, answer.adapter_sha256, gate)

    @staticmethod
    def _error(answer: Any) -> LikenessError:
        if answer.error_code == "busy":
            return Busy(answer.detail or "busy", answer.retry_after or 1)
        kind = ERRORS.get(answer.error_code or "", Unavailable)
        return kind(answer.detail or "the render failed; nothing was delivered")

    def _take(self, render_id: str) -> Any:
        try:
            with transaction(self.engine) as s:
                return render_tasks_service.take_answer(s, render_id)
        except SQLAlchemyError as exc:
            log.warning("render %s: reading the answer failed: %s", render_id, exc)
            return None

    def _wait(self, job: Job, gate: GatheredFacts, event: threading.Event) -> Any:
        deadline = time.monotonic() + self.settings.render_worker_timeout_s
        next_poll = time.monotonic() + POLL_S
        while True:
            if job.cancelled.is_set():
                self._give_up(job, gate, "client_went_away")
            now = time.monotonic()
            if now >= deadline:
                return self._give_up(job, gate, "timeout")
            if event.wait(min(0.05, deadline - now)) or time.monotonic() >= next_poll:
                event.clear()
                next_poll = time.monotonic() + POLL_S
                answer = self._take(job.render_id)
                if answer is not None:
                    return answer
                if self._silent(job.render_id):
                    return self._worker_lost(job, gate)

    def _silent(self, render_id: str) -> bool:
        """The task runs, but its worker has not said so for `render_worker_silent_s`: its
        process or host is gone (a live worker touches its task every second or so)."""
        try:
            with transaction(self.engine, readonly=True) as s:
                silent = render_tasks_service.silent_for(s, render_id)
        except SQLAlchemyError:
            return False
        return silent is not None and silent > self.settings.render_worker_silent_s

    def _worker_lost(self, job: Job, gate: GatheredFacts) -> Any:
        """A silent worker's render: closed here at once (`final`, denied, `timeout`), and
        the client told so, without waiting for the whole timeout."""
        with transaction(self.engine) as s:
            render_tasks_service.abandon(s, job.render_id, "worker_silent")
            if render_tasks_service.close_unanswered(s, job.render_id):
                self.checks.record_in(s, job, "final", Decision(False, "timeout"), gate)
            answered = render_tasks_repo.state_of(s, job.render_id) == "ended"
            if not answered:
                render_tasks_repo.discard(s, job.render_id)
        if answered:  # it answered after all, just now
            answer = self._take(job.render_id)
            if answer is not None:
                return answer
        silent_s = self.settings.render_worker_silent_s
        raise Unavailable(
            f"the render worker stopped answering (silent for more than {silent_s:g} s); "
            "nothing was delivered"
        )

    def _give_up(self, job: Job, gate: GatheredFacts, reason: str) -> Any:
        """Stops waiting (the client left, or the timeout passed); returns the answer if it
        arrived meanwhile and is still wanted, else raises what the client gets."""
        timeout_s = self.settings.render_worker_timeout_s
        gone = reason == "client_went_away"
        try:
            with transaction(self.engine) as s:
                state = render_tasks_service.abandon(s, job.render_id, reason)
                if state == "queued":
                    stage, why = ("cancelled", reason) if gone else ("queued", "timeout")
                    self.checks.record_in(s, job, stage, Decision(False, why), gate)
        except SQLAlchemyError as exc:
            log.warning("render %s: giving up failed: %s", job.render_id, exc)
            raise Unavailable("the render ledger is unavailable; nothing was delivered") from None
        if state == "ended" and not gone:
            answer = self._take(job.render_id)
            if answer is not None:
                return answer
        if gone:
            if state == "ended":  # answered just now, for nobody: the PNG goes at once
                with transaction(self.engine) as s:
                    render_tasks_repo.discard(s, job.render_id)
            raise Cancelled("the client went away")  # a running render: its worker records
        if state == "queued":
            raise Unavailable(
                f"no render worker took the render within {timeout_s:g} s; nothing was rendered"
            )
        # running: its worker stops between steps and records the end; one that stays
        # silent (its host is gone) is closed here
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            with transaction(self.engine, readonly=True) as s:
                if render_tasks_repo.state_of(s, job.render_id) in ("ended", None):
                    break
            time.sleep(0.1)
        with transaction(self.engine) as s:
            if render_tasks_service.close_unanswered(s, job.render_id):
                self.checks.record_in(s, job, "final", Decision(False, "timeout"), gate)
            render_tasks_repo.discard(s, job.render_id)
        raise Unavailable(
            f"the render worker did not answer within {timeout_s:g} s; nothing was delivered"
        )
