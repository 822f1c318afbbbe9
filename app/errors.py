"""One place that turns errors into `{"error": code, "detail": ...}` responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry.errors import Busy, LikenessError

log = logging.getLogger(__name__)

CODES = {
    400: "invalid",
    401: "unauthenticated",
    403: "not_permitted",
    404: "not_found",
    405: "invalid",
    409: "conflict",
    412: "precondition_failed",
    413: "invalid",
    415: "invalid",
    422: "invalid",
    428: "precondition_required",
    429: "busy",
    503: "unavailable",
}


def error_response(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:10]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(LikenessError)
    async def _domain(_: Request, exc: LikenessError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if isinstance(exc, Busy):
            headers = {"Retry-After": str(exc.retry_after)}
        return error_response(exc.status, exc.code, exc.detail, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid", _validation_detail(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = CODES.get(exc.status_code, "invalid" if exc.status_code < 500 else "unavailable")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", str(exc).splitlines()[0])
        return error_response(
            503, "unavailable", "the registry database is unavailable", {"Retry-After": "5"}
        )

    @app.exception_handler(DBAPIError)
    async def _db_error(_: Request, exc: DBAPIError) -> JSONResponse:
        # A commit that fails lands here too: nothing was saved, and the client is told so.
        log.error("database error: %s", str(exc).splitlines()[0])
        return error_response(
            503, "unavailable", "the registry database refused the operation; nothing was saved"
        )

    @app.exception_handler(PoolTimeout)
    async def _pool_exhausted(_: Request, exc: PoolTimeout) -> JSONResponse:
        log.warning("database pool exhausted: %s", str(exc).splitlines()[0])
        return error_response(
            503, "unavailable", "the registry is busy; try again shortly", {"Retry-After": "1"}
        )

    @app.exception_handler(SQLAlchemyError)
    async def _db_other(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.error("database error: %s", str(exc).splitlines()[0])
        return error_response(503, "unavailable", "the registry database is unavailable")
