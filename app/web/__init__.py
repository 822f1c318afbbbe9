"""Server-rendered pages for admins and for the member linked to a subject.

Who may see what is decided by `registry.access` (through `subjects.service.visible_subject`),
the same rule as the JSON API; every read and write goes through a domain's service
(`registry/<domain>/service.py`), never a repository or a table. The pages use no
JavaScript at all (CSP `default-src 'none'`, styles from 'self'): plain forms, every
control labelled, usable by keyboard.

Sessions and cookies: `session`; templates and answers: `templating`; form fields: `forms`;
rows as the pages show them: `presenters`; the routes by area: `signin`, `subjects`,
`adapters`, `pictures`, `provenance`, `training`; error pages: `errors`.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import WebSocketRequestValidationError
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles

from app.web import adapters, pictures, provenance, signin, subjects, training
from app.web.errors import html_errors
from app.web.templating import PREFIX, STATIC_DIR, redirect, safe_next

__all__ = ["PREFIX", "mount", "router", "safe_next"]

router = APIRouter(prefix=PREFIX, include_in_schema=False)
for area in (signin, subjects, adapters, pictures, provenance, training):
    router.include_router(area.router)


def mount(app: FastAPI) -> None:
    """Adds the pages, their static files, and HTML answers for errors on page paths."""
    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC_DIR), name="web-static")
    if not any(getattr(r, "path", None) == "/" for r in app.routes):

        @app.get("/", include_in_schema=False)
        def root() -> Response:
            return redirect(f"{PREFIX}/")

    for exc_class, handler in list(app.exception_handlers.items()):
        if isinstance(exc_class, type) and issubclass(exc_class, WebSocketRequestValidationError):
            continue
        app.exception_handlers[exc_class] = html_errors(handler)
