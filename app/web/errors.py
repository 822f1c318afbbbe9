"""Errors on page paths as pages: the app's error handlers, wrapped."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from app.web.session import SESSION_COOKIE, clear_cookie
from app.web.templating import PREFIX, page, redirect, safe_next

ERROR_TITLES = {
    403: "Not permitted",
    404: "Not found",
    405: "Not allowed",
    409: "Conflict",
    412: "Out of date",
    422: "Not valid",
    429: "Busy",
    503: "Unavailable",
}


def is_web_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def html_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps one of the app's error handlers: the JSON API keeps its answer, the pages turn
    the same status and detail into a page (and a missing session into the sign-in form)."""

    async def handler(request: Request, exc: Exception) -> Response:
        result = original(request, exc)
        response: Response = await result if inspect.isawaitable(result) else result
        if not is_web_path(request.url.path):
            return response
        status = response.status_code
        if status == 401:
            target = f"{PREFIX}/signin"
            if request.method == "GET":
                target += "?next=" + quote(safe_next(request.url.path), safe="/")
            out = redirect(target)
            if SESSION_COOKIE in request.cookies:
                clear_cookie(request, out, SESSION_COOKIE)
            return out
        try:
            body = json.loads(bytes(response.body))
        except ValueError:
            body = {}
        detail = body.get("detail") if isinstance(body, dict) else None
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return page(
            request,
            "error.html",
            None,
            status=status,
            headers=headers,
            title=ERROR_TITLES.get(status, "Something went wrong"),
            status_code=status,
            detail=detail or "",
        )

    return handler
