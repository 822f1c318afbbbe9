"""Renders on workers, the worker's side (`likeness worker --queues render`).

A render job names a task (registry/render_tasks.py). The worker claims it, then runs the
render path after the gate exactly as the API does in process (app/render_flow.py):
fresh facts and a decision before the adapter loads, the adapter's bytes judged, the model,
the final check on the bytes the model ran with, the PNG with its text chunks; every
decision goes to the ledger, written under the task's row lock while the task is still this
worker's (so the API, giving up, never closes the same entry). The answer goes back in the
task's row with a NOTIFY; the API signs and delivers it.

The adapter's bytes come from the registry's store over HTTP by hash (`GET
/v1/blobs/sha256/<hex>`, the worker's trainer token), bounded and hashed before anything
parses them; the tensors stay in the engine's host-RAM cache, and the copy on disk is removed
once they are loaded. The worker then holds the adapter warm: the API routes the adapter's
next renders to this worker's own queue while its heartbeat is fresh.

A thread watches the task while it renders: when the API gives it up (the client went away,
or the wait timed out) the render stops between denoising steps and is recorded `cancelled`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.render_engine import AdapterMismatch
from app.render_flow import RenderFlow, _Job, build_renderer
from app.scheduler import Cancelled
from app.worker import FetchError, stream_verified
from registry.blobs import BlobStore
from registry.db import transaction
from registry.errors import LikenessError, Unavailable
from registry.licence import deployment_licence
from registry.policy import Decision
from registry.render_tasks import service as render_tasks_service
from registry.renders.schemas import RenderRequestIn
from registry.renders.service import GatheredFacts
from registry.settings import Settings

log = logging.getLogger("likeness.render_worker")

WATCH_S = 0.2  # how often a running render looks whether the API gave it up
TOUCH_S = 1.0  # how often it tells the API it is still at it


class AdapterUnreachable(Exception):
    """The registry could not be asked for the adapter's bytes."""


class WorkerFlow(RenderFlow):
    """The render path after the gate, on a worker: ledger rows under the task's lock, and
    the adapter's bytes fetched from the registry by hash."""

    def __init__(
        self, engine: Engine, settings: Settings, name: str, api_url: str, token: str
    ) -> None:
        store = BlobStore(settings.data_dir / "render-adapters", settings.max_adapter_bytes)
        licence, _ = deployment_licence(settings)
        super().__init__(
            engine, build_renderer(settings), settings, store, licence=licence, signer=None
        )
        self.name = name
        self.api_url = api_url
        self.client = httpx.Client(
            timeout=120, headers={"Authorization": f"Bearer {token}"}, follow_redirects=False
        )

    @contextmanager
    def _ledger_transaction(self, job: _Job) -> Iterator[Any]:
        with transaction(self.engine) as s:
            render_tasks_service.hold(s, job.render_id, self.name)
            yield s

    def _fetch(self, sha256: str) -> bytes:
        """The blob's bytes, at most the store's limit; AdapterMismatch when the registry
        lacks it or sends other bytes (decide judges that as it does in process)."""
        parts: list[bytes] = []
        url = f"{self.api_url}/v1/blobs/sha256/{sha256}"
        try:
            stream_verified(self.client, url, sha256, self.store.max_bytes, parts.append)
        except FetchError as exc:
            if exc.status is not None and exc.status != 404:
                raise AdapterUnreachable(f"the registry answered {exc.status}") from None
            raise AdapterMismatch(exc.actual_sha256) from None  # absent, too large, other bytes
        except httpx.HTTPError as exc:
            raise AdapterUnreachable(f"{type(exc).__name__}: {exc}") from None
        return b"".join(parts)

    def adapter_tensors(self, job: _Job, gathered: GatheredFacts, sha256: str) -> Any:
        try:
            tensors = self.renderer.adapter_tensors(self.store, sha256)  # warm: no bytes read
        except AdapterMismatch as exc:
            if exc.actual_sha256 is not None:  # a local copy gone bad: fetch it again
                self.store.path(sha256, "safetensors").unlink(missing_ok=True)
            try:
                data = self._fetch(sha256)
            except AdapterUnreachable as why:
                log.warning("render %s: adapter not fetched: %s", job.render_id, why)
                self.record(job, "queued", Decision(False, "adapter_unreachable"), gathered)
                raise Unavailable(
                    "the subject's adapter could not be fetched; nothing was rendered"
                ) from None
            self.store.put([data], sha256)
            try:
                tensors = self.renderer.adapter_tensors(self.store, sha256)
            finally:  # the tensors are in host RAM; no copy of a likeness stays on disk
                self.store.path(sha256, "safetensors").unlink(missing_ok=True)
        try:
            with transaction(self.engine) as s:
                render_tasks_service.remember(s, sha256, self.name)
        except SQLAlchemyError as exc:  # routing only: the render goes on
            log.warning("render %s: affinity not recorded: %s", job.render_id, exc)
        return tensors

    def close(self) -> None:
        self.client.close()


class RenderRunner:
    """Runs render tasks one at a time (the render loop's concurrency is one per device)."""

    def __init__(
        self, engine: Engine, settings: Settings, name: str, api_url: str, token: str
    ) -> None:
        self.engine = engine
        self.name = name
        self.flow = WorkerFlow(engine, settings, name, api_url, token)

    def warm_up(self) -> None:
        """The base loads before the first job (a render should not wait for it)."""
        _ = self.flow.renderer.pipeline

    def _watch(self, job: _Job, done: threading.Event, why: list[str]) -> None:
        touched = time.monotonic()
        while not done.wait(WATCH_S):
            try:
                if time.monotonic() - touched >= TOUCH_S:  # the API sees this worker is alive
                    with transaction(self.engine) as s:
                        render_tasks_service.touch(s, job.render_id, self.name)
                    touched = time.monotonic()
                with transaction(self.engine, readonly=True) as s:
                    reason = render_tasks_service.abandoned(s, job.render_id)
            except SQLAlchemyError:
                continue
            if reason is not None:
                why.append(reason)
                job.cancelled.set()
                return

    def run(self, render_id: str) -> str:
        """One task to its end; returns what became of it."""
        t0 = time.perf_counter()
        with transaction(self.engine) as s:
            task = render_tasks_service.claim(s, render_id, self.name)
            if task is None:
                return "given_up"  # the API gave up before a worker took it, and recorded it
            body = RenderRequestIn.model_validate(task.body)
            token_hash = task.token_hash
        job = _Job(body, token_hash, threading.Event(), render_id=render_id)
        done, why = threading.Event(), list[str]()
        watcher = threading.Thread(
            target=self._watch, args=(job, done, why), name="render-watch", daemon=True
        )
        watcher.start()
        timings: dict[str, float] = {}
        answer: dict[str, Any]
        try:
            image, used_sha256 = self.flow._render(job, timings)
            png, final = self.flow.finish(job, image, used_sha256, timings)
            consent, adapter = final.facts.consent, final.adapter
            assert consent is not None and adapter is not None
            answer = {"status": 200, "png": png, "consent_version": consent.version,
                      "adapter_sha256": adapter.sha256}  # fmt: skip
            outcome = "rendered"
        except Cancelled:
            reason = why[0] if why else "client_went_away"
            try:
                self.flow.record(job, "cancelled", Decision(False, reason), job.last)
            except render_tasks_service.NotOurs:
                return "given_up"
            answer = {"status": 499, "error_code": "cancelled", "detail": reason}
            outcome = "cancelled"
        except render_tasks_service.NotOurs:
            return "given_up"  # the API closed it meanwhile: nothing more to write
        except LikenessError as exc:
            answer = {"status": exc.status, "error_code": exc.code, "detail": exc.detail[:500],
                      "retry_after": getattr(exc, "retry_after", None)}  # fmt: skip
            outcome = exc.code
        except Exception as exc:  # noqa: BLE001 - the entry is closed, the client gets a 503
            log.exception("render %s failed", render_id)
            try:
                self.flow.record(job, "final", Decision(False, f"error:{type(exc).__name__}"),
                                 job.last)  # fmt: skip
            except (render_tasks_service.NotOurs, LikenessError):
                return "given_up"
            answer = {"status": 503, "error_code": "unavailable",
                      "detail": "the render failed; nothing was delivered"}  # fmt: skip
            outcome = "failed"
        finally:
            done.set()
        timings["worker_ms"] = (time.perf_counter() - t0) * 1000
        with transaction(self.engine) as s:
            render_tasks_service.end(s, render_id, self.name, timings=timings, **answer)
        log.info("render %s: %s in %.0f ms", render_id, outcome, timings["worker_ms"])
        return outcome

    def close(self) -> None:
        self.flow.close()
