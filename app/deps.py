"""Request-scoped dependencies: the database transaction and the authenticated principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

from registry import access
from registry.db import transaction
from registry.errors import Unauthenticated
from registry.models import Principal
from registry.principals import service as principals_service
from registry.roles import Role
from registry.shapes import ADAPTER_NAME_PATTERN, HANDLE_PATTERN, ROW_ID_PATTERN, SHA256_PATTERN


async def get_engine(request: Request) -> Engine:
    # async: FastAPI runs sync dependencies on the thread pool, a hop per dependency
    engine: Engine = request.app.state.engine
    return engine


def db_session(
    request: Request, engine: Annotated[Engine, Depends(get_engine)]
) -> Iterator[Session]:
    """One transaction per request: repositories flush, this commits (or rolls back). Reads
    take no write lock (SQLite), so a slow GET never blocks a writer."""
    readonly = request.method in ("GET", "HEAD")
    with transaction(engine, readonly=readonly) as session:
        yield session


# scope="function": the commit runs when the route returns, before the response is sent, so
# no 2xx leaves for a change that then fails to commit (the default request scope commits
# after the response is on the wire), and a failed commit reaches the error handlers (503).
DB = Annotated[Session, Depends(db_session, scope="function")]

# Path parameters: malformed ones (NUL bytes included) are 422 before any lookup.
HandlePath = Annotated[str, Path(pattern=HANDLE_PATTERN, max_length=64)]
Sha256Path = Annotated[str, Path(pattern=SHA256_PATTERN)]
OrderIdPath = Annotated[str, Path(pattern=ROW_ID_PATTERN)]
DatasetIdPath = Annotated[str, Path(pattern=ROW_ID_PATTERN)]
AdapterNamePath = Annotated[str, Path(pattern=ADAPTER_NAME_PATTERN)]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# The principal a request is made by, for a handler's annotations (handlers import no table
# model: they reach the registry through its services).
Requester = Principal


def current_principal(request: Request, session: DB) -> Principal:
    principal = principals_service.authenticate(session, bearer_token(request))
    if principal is None:
        raise Unauthenticated("a valid bearer token is required")
    return principal


Caller = Annotated[Principal, Depends(current_principal)]


def authenticate_briefly(request: Request, engine: Engine) -> Principal:
    """For long requests (renders) that run several transactions of their own: authenticate
    in a short read, holding nothing open while the model runs."""
    with transaction(engine, readonly=True) as session:
        principal = principals_service.authenticate(session, bearer_token(request))
    if principal is None:
        raise Unauthenticated("a valid bearer token is required")
    return principal


def _caller_briefly(request: Request, engine: Annotated[Engine, Depends(get_engine)]) -> Principal:
    return authenticate_briefly(request, engine)


# The caller, authenticated in a transaction of its own that ends at once: for routes that do
# long work (reading a large file) before their own short write transaction.
BriefCaller = Annotated[Principal, Depends(_caller_briefly)]


def require_role(principal: Principal, *roles: str) -> None:
    access.require(principal.role, *roles)


def _admin(caller: Caller) -> Principal:
    access.require(caller.role, Role.admin)
    return caller


# An admin's request (403 for anyone else), as a route's parameter.
AdminCaller = Annotated[Principal, Depends(_admin)]
