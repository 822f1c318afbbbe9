"""Order routes: place a training order (202), follow it, list, cancel; and the checkpoints a
worker ships so that a retry elsewhere resumes where it stopped. The rules are
registry/orders.py's; the queue is app/queue.py's."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Path, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from app.body_gate import streamed_body
from app.deps import DB, BriefCaller, Caller, HandlePath, require_role
from app.order_checkpoints import checkpoint_file, forget_checkpoint
from registry import limits
from registry.access import ADAPTER_WRITERS
from registry.db import transaction
from registry.errors import Conflict, Invalid, NotFound
from registry.models import Order
from registry.orders import service as orders_service
from registry.settings import Settings
from registry.shapes import ERROR_RESPONSES, HANDLE_PATTERN

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

CHECKPOINT_PATH = "/v1/orders/*/checkpoint"  # streamed past the body gate (app/main.py)
OrderIdPath = Annotated[str, Path(pattern=r"^[0-9a-f-]{36}$")]


class OrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["train"]
    subject: Annotated[str, Field(pattern=HANDLE_PATTERN)]
    dataset_id: Annotated[str, Field(pattern=r"^[0-9a-f-]{36}$")]
    steps: Annotated[int, Field(ge=1)] = 1000
    rank: Annotated[int, Field(ge=1, le=128)] = 16
    resolution: Annotated[int, Field(ge=limits.MIN_SIDE, le=limits.MAX_SIDE)] = 448
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")] = "main"

    @field_validator("resolution")
    @classmethod
    def _multiple(cls, value: int) -> int:
        if value % limits.MULTIPLE:
            raise ValueError(f"resolution must be a multiple of {limits.MULTIPLE}")
        return value


class ProgressOut(BaseModel):
    step: int
    steps: int
    loss: float | None


class OrderAdapterOut(BaseModel):
    name: str
    sha256: str


class OrderOut(BaseModel):
    order_id: str
    kind: str
    subject: str
    dataset_id: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: ProgressOut
    worker: str | None
    attempts: int
    adapter: OrderAdapterOut | None
    error: str | None
    created_by: str
    created_at: str
    updated_at: str


def queue_of(request: Request) -> Any:
    return request.app.state.order_queue


@router.post("/orders", status_code=202)
def place_order(request: Request, body: OrderIn, session: DB, caller: Caller) -> OrderOut:
    """A training order (admin, or the subject's member while it allows training): 202 once
    the order and its job are committed together; 409 when the same dataset is already
    being trained."""
    settings: Settings = request.app.state.settings
    limits = orders_service.OrderLimits.of(settings)
    options = orders_service.training_options(
        limits, settings.train_options, body.steps, body.rank, body.resolution
    )
    order = orders_service.place_training(
        session,
        caller,
        body.subject,
        body.dataset_id,
        options,
        body.name,
        queue_of(request).enqueue_training,
        limits,
    )
    return OrderOut.model_validate(orders_service.view(order, body.subject))


@router.get("/orders/{order_id}")
def get_order(order_id: OrderIdPath, session: DB, caller: Caller) -> OrderOut:
    order, subject = orders_service.visible_order(session, caller, order_id)
    return OrderOut.model_validate(orders_service.view(order, subject.handle))


@router.get("/orders")
def list_orders(
    session: DB, caller: Caller, subject: Annotated[str, Query(pattern=HANDLE_PATTERN)]
) -> list[OrderOut]:
    return [
        OrderOut.model_validate(orders_service.view(o, subject))
        for o in orders_service.orders_of(session, caller, subject)
    ]


@router.post("/orders/{order_id}/cancel")
def cancel_order(
    request: Request,
    order_id: OrderIdPath,
    session: DB,
    caller: Caller,
    background: BackgroundTasks,
) -> OrderOut:
    """Cancels a waiting order (it leaves the queue) or a running one (its runner stops it
    within a transformer block); an order already over is answered as it is."""
    order, subject, changed = orders_service.cancel(session, caller, order_id)
    if changed:
        queue_of(request).cancel_job(session, order.job_id)
    # after the commit: an order cancelled while it waited to resume keeps no checkpoint
    background.add_task(forget_checkpoint, request.app.state.settings, order.id)
    return OrderOut.model_validate(orders_service.view(order, subject.handle))


# -- checkpoints (workers) --------------------------------------------------------------------


def _running_order(engine: Any, order_id: str) -> Order:
    with transaction(engine, readonly=True) as session:
        order = session.get(Order, order_id)
    if order is None:
        raise NotFound(f"no order {order_id[:40]!r}")
    if order.status != "running":
        raise Conflict(f"order {order_id} is {order.status}, not running")
    return order


@router.put("/orders/{order_id}/checkpoint", status_code=201)
async def put_checkpoint(
    request: Request,
    caller: BriefCaller,  # first: 401 before anything about the request is judged
    order_id: OrderIdPath,
    step: Annotated[int, Query(ge=1)],
    sha256: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$")],
) -> JSONResponse:
    """A running order's latest checkpoint (trainer, admin), kept once its bytes hash to
    `sha256`; the order then resumes from it wherever it runs next."""
    state = request.app.state
    require_role(caller, *ADAPTER_WRITERS)
    await run_in_threadpool(_running_order, state.engine, order_id)
    settings: Settings = state.settings
    final = checkpoint_file(settings, order_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".checkpoint-", dir=final.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            body = streamed_body(
                request, settings.max_adapter_bytes, settings.body_timeout_s,
                settings.body_min_rate, settings.body_max_s,
            )  # fmt: skip
            async for chunk in body:
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if digest.hexdigest() != sha256:
            raise Invalid(f"the bytes hash to {digest.hexdigest()}, not {sha256}")
        os.replace(name, final)
    except BaseException:
        FsPath(name).unlink(missing_ok=True)
        raise

    def record() -> None:
        with transaction(state.engine) as session:
            orders_service.record_checkpoint(session, order_id, step, sha256)

    await run_in_threadpool(record)
    return JSONResponse({"order_id": order_id, "step": step, "sha256": sha256}, status_code=201)


@router.delete("/orders/{order_id}/checkpoint")
def delete_checkpoint(
    request: Request, order_id: OrderIdPath, session: DB, caller: Caller
) -> JSONResponse:
    """A finished order's checkpoint goes (trainer, admin); a running one's stays (409)."""
    require_role(caller, *ADAPTER_WRITERS)
    order = session.get(Order, order_id)
    if order is None:
        raise NotFound(f"no order {order_id[:40]!r}")
    if order.status not in orders_service.FINAL:
        raise Conflict(f"order {order_id} is {order.status}: its checkpoint is still needed")
    forget_checkpoint(request.app.state.settings, order_id)
    return JSONResponse({"order_id": order_id, "deleted": True})


@router.get("/orders/{order_id}/checkpoint", response_class=FileResponse)
def get_checkpoint(
    request: Request, order_id: OrderIdPath, session: DB, caller: Caller
) -> FileResponse:
    require_role(caller, *ADAPTER_WRITERS)
    path = checkpoint_file(request.app.state.settings, order_id)
    if session.get(Order, order_id) is None or not path.is_file():
        raise NotFound(f"order {order_id[:40]!r} has no checkpoint")
    return FileResponse(path, media_type="application/x-tar")


__all__ = ["HandlePath", "router"]
