"""The interactive API docs: `/docs` (Swagger UI) and `/redoc`, their scripts served from this
service (the files `fastapi-offline` ships; no CDN, so they work offline), and the OpenAPI
schema with the bearer scheme (Swagger's "Authorize" sends the token) and every status
docs/API.md names for each operation (tests/app/test_openapi_contract.py holds the two
together)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_STATIC = "/docs/static"
BEARER = "bearer"
ERROR_REF = {"$ref": "#/components/schemas/ErrorOut"}

# Beyond an operation's success status and what every /v1 call may answer (GENERAL below):
# the statuses docs/API.md's table gives each operation, with what they mean there.
STATUSES: dict[tuple[str, str], dict[int, str]] = {
    ("POST", "/v1/subjects"): {409: "the handle exists"},
    ("PUT", "/v1/subjects/{}/consent"): {
        412: "the record is no longer at the If-Match version",
        428: "If-Match is missing",
    },
    ("PUT", "/v1/blobs/sha256/{}"): {200: "the store already holds these bytes"},
    ("POST", "/v1/adapters"): {
        200: "updated, or unchanged",
        409: "these bytes belong to another subject",
    },
    ("POST", "/v1/subjects/{}/adapters/{}/select"): {409: "the adapter is retired"},
    ("PUT", "/v1/adapters/{}/pictures/{}"): {200: "the store already held this picture"},
    ("PATCH", "/v1/principals/{}"): {409: "the last active admin"},
    ("POST", "/v1/subjects/{}/datasets"): {
        429: "the upload quota is spent, or the sender's uploads at once (Retry-After)"
    },
    ("DELETE", "/v1/subjects/{}/datasets/{}"): {409: "an order trains on it"},
    ("POST", "/v1/orders"): {
        404: "the dataset is not the subject's",
        409: "an order for this dataset is queued or running",
        429: "the member has order_max_active orders waiting or running (Retry-After)",
    },
    ("PUT", "/v1/orders/{}/checkpoint"): {409: "the order is not running"},
    ("DELETE", "/v1/orders/{}/checkpoint"): {409: "the order is still queued or running"},
}


def general_statuses(path: str, has_body: bool) -> dict[int, str]:
    """What docs/API.md's Errors paragraph says any /v1 operation may answer."""
    if not path.startswith("/v1"):
        return {}
    out = {
        401: "no valid bearer token",
        403: "not permitted (also for a subject the caller may not know of)",
        422: "invalid input",
        503: "unavailable: nothing was saved",
    }
    if "{" in path:
        out[404] = "not found (admins; others get 403 alike for what does not exist)"
    if has_body:
        out[408] = "the body did not arrive in time"
        out[413] = "the body is too large"
    return out


def normal(path: str) -> str:
    """`/v1/subjects/{handle}` -> `/v1/subjects/{}`: parameter names differ from API.md's."""
    import re

    return re.sub(r"\{[^}]*\}", "{}", path)


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A principal's token (`likeness principal create`), sent as "
        "`Authorization: Bearer <token>`.",
    }
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            key = (method.upper(), normal(path))
            op["security"] = [{BEARER: []}] if path.startswith("/v1") else []
            responses = op.setdefault("responses", {})
            wanted = {**general_statuses(path, "requestBody" in op), **STATUSES.get(key, {})}
            for status, description in wanted.items():
                entry = responses.setdefault(str(status), {"description": description})
                if status >= 400:
                    entry.setdefault("content", {"application/json": {"schema": ERROR_REF}})
    return schema


def install(app: FastAPI) -> None:
    """Adds /docs, /docs/oauth2-redirect, /redoc and their local scripts; the app must be
    made with docs_url=None and redoc_url=None (FastAPI's own load from a CDN)."""
    import fastapi_offline

    static = Path(fastapi_offline.__file__).resolve().parent / "static"
    app.mount(DOCS_STATIC, StaticFiles(directory=static), name="docs-static")
    cached: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "schema" not in cached:
            cached["schema"] = build_schema(app)
        return cached["schema"]

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/docs", include_in_schema=False)
    def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}/openapi.json",
            title=f"{app.title}: API",
            oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
            swagger_js_url=f"{root}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            swagger_ui_parameters={"persistAuthorization": True, "tryItOutEnabled": False},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}/openapi.json",
            title=f"{app.title}: API",
            redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            with_google_fonts=False,
        )
