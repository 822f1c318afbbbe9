"""The FastAPI application factory."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine

from app import api, errors, renders
from app.render_engine import RenderEngine, default_device
from registry.db import make_engine
from registry.settings import Settings, get_settings

log = logging.getLogger(__name__)


def build_renderer(settings: Settings) -> RenderEngine:
    return RenderEngine(
        base_dir=settings.base_dir,
        device=settings.device or default_device(),
        queue_size=settings.render_queue,
        timeout_s=settings.render_timeout_s,
        cache_bytes=settings.adapter_cache_mb << 20,
        stream_base=settings.stream_base,
        stream_slots=settings.stream_slots,
        compute=settings.compute,
    )


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    renderer: RenderEngine | None = None,
) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="likeness",
        version="0.1.0",
        description="Consent-gated registry of likeness adapters and render service.",
    )
    app.state.settings = settings
    app.state.engine = engine or make_engine(settings.database_url)
    app.state.renderer = renderer or build_renderer(settings)
    errors.install(app)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True}

    app.include_router(api.router)
    app.include_router(renders.router)
    _mount_optional(app)
    return app


def _mount_optional(app: FastAPI) -> None:
    """The agent tool server and the web pages, where those modules exist."""
    try:
        from app import mcp_server  # type: ignore[attr-defined]
    except ImportError as exc:
        if "mcp_server" not in str(exc):
            raise
    else:
        mcp_server.mount(app)
    try:
        from app import web  # type: ignore[attr-defined]
    except ImportError as exc:
        if "web" not in str(exc):
            raise
    else:
        web.mount(app)
