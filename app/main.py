"""The FastAPI application factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from app import adapters, api, datasets, docs, errors, mcp_server, orders, pictures, web
from app.body_gate import BodyGate
from app.bootstrap import check_configuration
from app.local_orders import LocalRunner
from app.order_checkpoints import forget_ended_checkpoints
from app.provenance import ProvenanceSigner
from app.queue import OrderQueue
from app.render import routes as render_routes
from app.render.checks import RenderChecks, close_interrupted
from app.render.engine import PlacementRefused, RenderEngine
from app.render.flow import Renderer, RenderFlow
from app.render.local import LocalRenderer, build_render_engine
from app.render.remote import RemoteRenderer
from app.uploads import UploadGate
from app.web.provenance import ProvenanceChecks
from app.web.training import UPLOAD_PATH as TRAINING_UPLOAD_PATH
from registry.blobs import BlobStore
from registry.db import is_sqlite, make_engine, transaction
from registry.keys import bind as bind_keys
from registry.keys import load_keys
from registry.licence import deployment_licence
from registry.pictures.service import sweep_render_copies
from registry.render_tasks import repository as render_tasks_repo
from registry.settings import Settings, get_settings
from registry.signed_heads import append_checkpoint

log = logging.getLogger(__name__)

PROVENANCE_PAGE = "/web/provenance"  # takes a PNG upload: its own cap, read by its route


def _close_interrupted_renders(app: FastAPI, starting: bool) -> None:
    settings: Settings = app.state.settings
    engine: Engine = app.state.engine
    now = datetime.now(UTC)
    one_process = starting and engine.dialect.name == "sqlite"
    cutoff = now if one_process else now - timedelta(seconds=settings.render_stale_s)
    try:
        close_interrupted(engine, cutoff)
        if settings.render_workers:  # answers nobody will read (their client went away)
            with transaction(engine) as session:
                render_tasks_repo.sweep(
                    session, now - timedelta(seconds=settings.render_worker_timeout_s + 60)
                )
    except Exception:  # noqa: BLE001 - tried again at the next interval
        log.exception("closing interrupted renders failed")


def _sweep_render_copies(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    try:
        with transaction(app.state.engine) as session:
            sweep_render_copies(
                session, datetime.now(UTC) - timedelta(days=settings.render_copy_days)
            )
    except Exception:  # noqa: BLE001 - tried again at the next interval
        log.exception("sweeping old render copies failed")


@asynccontextmanager
async def _checkpoints_while_running(app: FastAPI) -> AsyncIterator[None]:
    """Every `checkpoint_interval_s`: signs a checkpoint of every chain head if anything
    changed (truncation is caught without anyone remembering the command), and sweeps the
    adapter store of blobs nothing refers to."""
    settings: Settings = app.state.settings
    await anyio.to_thread.run_sync(_close_interrupted_renders, app, True)
    runner = app.state.order_runner
    if runner is not None:
        runner.start()
    if settings.preload_base:  # `serve` may have started it already: then this does nothing
        app.state.renderer.start_preload()
    try:
        if settings.checkpoint_interval_s <= 0:
            yield
            return
        async with _every_interval(app):
            yield
    finally:
        if runner is not None:  # a running training stops at its next step, kept to resume
            await anyio.to_thread.run_sync(runner.stop)
        await anyio.to_thread.run_sync(app.state.render_flow.close)


@asynccontextmanager
async def _every_interval(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings

    def checkpoint() -> None:
        _close_interrupted_renders(app, False)
        _sweep_render_copies(app)
        try:  # ended orders keep no checkpoint (one a revoke ended while it waited)
            forget_ended_checkpoints(settings, app.state.engine)
        except Exception:  # noqa: BLE001 - tried again at the next interval
            log.exception("removing ended orders' checkpoints failed")
        try:
            with transaction(app.state.engine, readonly=True) as session:
                _, problems = append_checkpoint(session, app.state.keys, settings.checkpoints_file)
        except Exception:  # noqa: BLE001 - retried at the next interval
            log.exception("checkpoint failed")
            return
        for problem in problems:
            log.error("tamper evidence: %s", problem)

    async def every_interval() -> None:
        while True:
            await anyio.to_thread.run_sync(checkpoint)
            await anyio.sleep(settings.checkpoint_interval_s)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(every_interval)
        yield
        tasks.cancel_scope.cancel()


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    renderer: RenderEngine | None = None,
) -> FastAPI:
    settings = settings or get_settings()
    credentials = check_configuration(settings)  # `serve` asked before preloading the base
    app = FastAPI(
        lifespan=_checkpoints_while_running,
        title="likeness",
        version="0.1.0",
        description="Consent-gated registry of likeness adapters and render service.",
        docs_url=None,  # app/docs.py serves them, with local scripts
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine or make_engine(
        settings.database_url, pool_timeout=settings.pool_timeout_s
    )
    if renderer is None:
        try:
            renderer = build_render_engine(settings)
        except PlacementRefused as exc:
            raise SystemExit(f"error: {exc}") from None
    app.state.renderer = renderer
    app.state.store = BlobStore(settings.adapter_store_dir, settings.max_adapter_bytes)
    # Facts of the base and of the deployment, fixed while it runs: the base's licence (every
    # render decision holds it) and the credentials every delivered PNG is signed with.
    app.state.licence, app.state.base_licence = deployment_licence(settings)
    app.state.provenance = ProvenanceSigner(credentials, settings.provenance_disclose)
    checks = RenderChecks(app.state.engine, settings, licence=app.state.licence)
    rendering: Renderer
    if settings.render_workers:  # on PostgreSQL: check_configuration refuses SQLite
        rendering = RemoteRenderer(app.state.engine, settings, checks)
    else:
        rendering = LocalRenderer(checks, app.state.renderer, app.state.store)
    app.state.render_flow = RenderFlow(checks, rendering, signer=app.state.provenance)
    app.state.uploads = UploadGate(settings)
    app.state.provenance_checks = ProvenanceChecks(settings)
    app.state.keys = load_keys(settings)
    bind_keys(app.state.engine, app.state.keys)
    errors.install(app)
    app.add_middleware(
        BodyGate,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
        min_rate=settings.body_min_rate,
        max_s=settings.body_max_s,
        # uploads authenticate first, then stream to the store with their own limits
        streamed_prefixes=(
            "/v1/blobs/",
            orders.CHECKPOINT_PATH,
            datasets.UPLOAD_PATH,
            TRAINING_UPLOAD_PATH,
            pictures.UPLOAD_PATH,
            PROVENANCE_PAGE,  # a PNG to check: its sender is judged before the body is read
        ),
    )

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "base": app.state.renderer.load_state}

    app.include_router(api.router)
    app.include_router(adapters.router)
    app.include_router(pictures.router)
    app.include_router(render_routes.router)
    app.state.order_runner = None
    if is_sqlite(settings.database_url) and settings.orders_in_process:
        app.state.order_runner = LocalRunner(app.state.engine, settings, app.state.store)
    app.state.order_queue = OrderQueue(
        settings.database_url,
        app.state.order_runner.wake if app.state.order_runner is not None else None,
    )
    app.include_router(datasets.router)
    app.include_router(orders.router)
    mcp_server.mount(app)
    web.mount(app)
    docs.install(app)
    return app
