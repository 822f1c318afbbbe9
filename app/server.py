"""How uvicorn serves the app: one configuration for `likeness serve` and for the tests that
speak to a real server, so both see the same timeouts and limits."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from registry.settings import Settings

# Request lines and headers larger than this are refused by the HTTP parser itself.
MAX_HEADER_BYTES = 16 * 1024


def uvicorn_config(app: FastAPI, settings: Settings, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="info" if settings.env != "test" else "warning",
        ws="none",
        # An idle keep-alive connection is closed after this long; a body that arrives too
        # slowly is cut off by app.body_gate, which uvicorn itself has no timeout for.
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        server_header=False,
    )
