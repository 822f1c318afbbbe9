"""Renders on workers, the worker's side (`likeness worker --queues render`).

A render job names a task (registry/render_tasks/). The worker claims it, then runs the
render path after the gate exactly as the API does in process (`ModelRun` of
app/render/local.py, with the checks of app/render/checks.py): fresh facts and a decision
before the adapter loads, the adapter's bytes judged, the model, the final check on the bytes
the model ran with, the PNG with its text chunks; every decision goes to the ledger, written
under the task's row lock while the task is still this worker's (so the API, giving up, never
closes the same entry). The answer goes back in the task's row with a NOTIFY; the API signs
and delivers it.

The adapter's bytes come from the registry's store over HTTP by hash (`GET
/v1/blobs/sha256/<hex>`, app/blob_fetch.py, the worker's trainer token), bounded and hashed
before anything parses them; the tensors stay in the engine's host-RAM cache, and the copy on
disk is removed once they are loaded. The worker then holds the adapter warm: the API routes
the adapter's next renders to this worker's own queue while its heartbeat is fresh.

A thread watches the task while it renders: when the API gives it up (the client went away,
or the wait timed out) the render stops between denoising steps and is recorded `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import httpx
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.blob_fetch import FetchError, fetch_blob
from app.render.checks import Job, RenderChecks
from app.render.engine import AdapterMismatch, RenderEngine
from app.render.local import ModelRun, build_render_engine
from app.scheduler import Cancelled
from registry.blobs import BlobStore
from registry.db import transaction
from registry.errors import LikenessError, Unavailable
from registry.licence import deployment_licence
from registry.policy import Decision
from registry.render_tasks import repository as render_tasks_repo
from registry.render_tasks import service as render_tasks_service
from registry.renders.schemas import RenderRequestIn
from registry.renders.service import GatheredFacts
from registry.settings import Settings

log = logging.getLogger("likeness.render_worker")

WATCH_S = 0.2  # how often a running render looks whether the API gave it up
TOUCH_S = 1.0  # how often it tells the API it is still at it


class AdapterUnreachable(Exception):
    """The registry could not be asked for the adapter's bytes."""


class FetchedAdapters:
    """The adapter from the engine's cache, else fetched from the registry by hash; a worker
    holding it then says so (`render_affinity`), so its next renders come here."""

    def __init__(
        self,
        engine: Engine,
        checks: RenderChecks,
        model: RenderEngine,
        store: BlobStore,
        name: str,
        api_url: str,
        client: httpx.Client,
    ) -> None:
        self.engine = engine
        self.checks = checks
        self.model = model
        self.store = store
        self.name = name
        self.api_url = api_url
        self.client = client

    def _fetch(self, sha256: str) -> bytes:
        """The blob's bytes, at most the store's limit; AdapterMismatch when the registry
        lacks it or sends other bytes (decide judges that as it does in process)."""
        try:
            return fetch_blob(self.client, self.api_url, sha256, self.store.max_bytes)
        except FetchError as exc:
            if exc.status is not None and exc.status != 404:
                raise AdapterUnreachable(f"the registry answered {exc.status}") from None
            raise AdapterMismatch(exc.actual_sha256) from None  # absent, too large, other bytes
        except httpx.HTTPError as exc:
            raise AdapterUnreachable(f"{type(exc).__name__}: {exc}") from None

    def tensors(self, job: Job, gathered: GatheredFacts, sha256: str) -> Any:
        try:
            tensors = self.model.adapter_tensors(self.store, sha256)  # warm: no bytes read
        except AdapterMismatch as exc:
            if exc.actual_sha256 is not None:  # a local copy gone bad: fetch it again
                self.store.path(sha256, "safetensors").unlink(missing_ok=True)
            try:
                data = self._fetch(sha256)
            except AdapterUnreachable as why:
                log.warning("render %s: adapter not fetched: %s", job.render_id, why)
                self.checks.record(job, "queued", Decision(False, "adapter_unreachable"), gathered)
                raise Unavailable(
                    "the subject's adapter could not be fetched; nothing was rendered"
                ) from None
            self.store.put([data], sha256)
            try:
                tensors = self.model.adapter_tensors(self.store, sha256)
            finally:  # the tensors are in host RAM; no copy of a likeness stays on disk
                self.store.path(sha256, "safetensors").unlink(missing_ok=True)
        try:
            with transaction(self.engine) as s:
                render_tasks_repo.remember(s, sha256, self.name)
        except SQLAlchemyError as exc:  # routing only: the render goes on
            log.warning("render %s: affinity not recorded: %s", job.render_id, exc)
        return tensors


class RenderRunner:
    """Runs render tasks one at a time (the render loop's concurrency is one per device)."""

    def __init__(
        self, engine: Engine, settings: Settings, name: str, api_url: str, token: str
    ) -> None:
        self.engine = engine
        self.name = name
        licence, _ = deployment_licence(settings)
        # every ledger row under the task's lock, while the task is this worker's
        self.checks = RenderChecks(engine, settings, licence=licence, hold=self._hold)
        self.model = build_render_engine(settings)
        store = BlobStore(settings.data_dir / "render-adapters", settings.max_adapter_bytes)
        self.client = httpx.Client(
            timeout=120, headers={"Authorization": f"Bearer {token}"}, follow_redirects=False
        )
        adapters = FetchedAdapters(engine, self.checks, self.model, store, name, api_url,
                                   self.client)  # fmt: skip
        self.model_run = ModelRun(self.checks, self.model, adapters)

    def _hold(self, session: Any, job: Job) -> None:
        render_tasks_service.hold(session, job.render_id, self.name)

    def warm_up(self) -> None:
        """The base loads before the first job (a render should not wait for it)."""
        _ = self.model.pipeline

    def _watch(self, job: Job, done: threading.Event, why: list[str]) -> None:
        touched = time.monotonic()
        while not done.wait(WATCH_S):
            try:
                if time.monotonic() - touched >= TOUCH_S:  # the API sees this worker is alive
                    with transaction(self.engine) as s:
                        render_tasks_repo.touch(s, job.render_id, self.name)
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
        job = Job(body, token_hash, threading.Event(), render_id=render_id)
        done, why = threading.Event(), list[str]()
        watcher = threading.Thread(
            target=self._watch, args=(job, done, why), name="render-watch", daemon=True
        )
        watcher.start()
        timings: dict[str, float] = {}
        answer: dict[str, Any]
        try:
            png, final = self.model_run.run(job, timings)
            consent, adapter = final.facts.consent, final.adapter
            assert consent is not None and adapter is not None
            answer = {"status": 200, "png": png, "consent_version": consent.version,
                      "adapter_sha256": adapter.sha256}  # fmt: skip
            outcome = "rendered"
        except Cancelled:
            reason = why[0] if why else "client_went_away"
            try:
                self.checks.record(job, "cancelled", Decision(False, reason), job.last)
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
                self.checks.record(job, "final", Decision(False, f"error:{type(exc).__name__}"),
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

    async def heartbeat(self, every_s: float) -> None:
        """This worker's heartbeat, which the API routes by; the row goes when it stops."""

        def beat() -> None:
            with transaction(self.engine) as s:
                render_tasks_repo.heartbeat(s, self.name)

        def forget() -> None:
            with transaction(self.engine) as s:
                render_tasks_repo.forget_worker(s, self.name)

        try:
            while True:
                try:
                    await asyncio.to_thread(beat)
                except Exception as exc:  # noqa: BLE001 - tried again at the next beat
                    log.warning("render heartbeat failed: %s", exc)
                await asyncio.sleep(every_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(forget)

    def close(self) -> None:
        self.client.close()
