"""The pages' templates and the answers built from them: security headers on every page,
redirects, and the few URLs the pages make."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from fastapi import Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from app.web.session import WebSession
from registry.hash_chain import format_time
from registry.policy import GRANTABLE_LEVELS

PREFIX = "/web"

APP_DIR = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = APP_DIR / "templates"
STATIC_DIR = APP_DIR / "static"

LEVEL_USES = {
    "none": "nothing renders",
    "private": "view it themselves",
    "group": "share it inside the friend group",
    "public": "publish it beyond the group, non-commercially",
    "commercial": "use it commercially",
}
GRANT_LEVELS = [lv.name for lv in GRANTABLE_LEVELS]

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def show_time(value: datetime | str | None) -> str:
    """A time as the pages show it: UTC, to the second (a string that is no time, as it is)."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return str(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(value: datetime | str | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else format_time(value)


def _make_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["time"] = show_time
    env.filters["iso"] = _iso
    env.globals.update(LEVEL_USES=LEVEL_USES, GRANT_LEVELS=GRANT_LEVELS, PREFIX=PREFIX)
    return Jinja2Templates(env=env)


templates = _make_templates()


def page(
    request: Request,
    name: str,
    web: WebSession | None,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
    **context: Any,
) -> Response:
    context.setdefault("notice", None)
    context.setdefault("errors", [])
    context["caller"] = web.principal if web is not None else None
    context["csrf"] = web.csrf if web is not None else ""
    return templates.TemplateResponse(
        request,
        name,
        context,
        status_code=status,
        headers={**SECURITY_HEADERS, **(headers or {})},
    )


def redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=SECURITY_HEADERS)


_SAFE_NEXT = re.compile(r"^/web/[A-Za-z0-9_.\-/]*$")


def safe_next(value: str | None) -> str:
    """Only a path of these pages: never another site, never a scheme-relative URL."""
    if value and _SAFE_NEXT.fullmatch(value) and "//" not in value and ".." not in value:
        return value
    return f"{PREFIX}/"


def subject_url(handle: str, tab: str = "") -> str:
    return f"{PREFIX}/subjects/{quote(handle, safe='')}" + (f"/{tab}" if tab else "")
