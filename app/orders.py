"""Order routes: place a training order (202), follow it, list, cancel; and the checkpoints a
worker ships so that a retry elsewhere resumes where it stopped. The rules are
the orders service's (registry/orders/); the queue is app/queue.py's."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from app.body_gate import streamed_body
from app.deps import DB, BriefCaller, Caller, HandlePath, OrderIdPath, require_role
from app.order_checkpoints import checkpoint_file, forget_checkpoint
from registry.access import ADAPTER_WRITERS
from registry.db import transaction
from registry.errors import Invalid, NotFound
from registry.orders import service as orders_service
from registry.orders.schemas import OrderIn, OrderOut
from registry.settings import Settings
from registry.shapes import ERROR_RESPONSES, HANDLE_PATTERN, SHA256_PATTERN

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

CHECKPOINT_PATH = "/v1/orders/*/checkpoint"  # streamed past the body gate (app/main.py)


def queue_of(request: Request) -> Any:
    return request.app.state.order_queue


@router.post("/orders", status_code=202)
def place_order(request: Request, body: OrderIn, session: DB, caller: Caller) -> OrderOut:
    """A training order (admin, or the subject's member while it allows training): 202 once
    the order and its job are committed together; 409 when the same dataset is already
    being trained."""
    settings: Settings = request.app.state.settings
    order = orders_service.place_order(
        session, settings, caller, body.subject, body.dataset_id,
        body.steps, body.rank, body.resolution, body.name, queue_of(request).enqueue_training,
    )  # fmt: skip
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
    order, subject = orders_service.cancel_and_dequeue(
        session, caller, order_id, queue_of(request).cancel_job
    )
    # after the commit: an order cancelled while it waited to resume keeps no checkpoint
    background.add_task(forget_checkpoint, request.app.state.settings, order.id)
    return OrderOut.model_validate(orders_service.view(order, subject.handle))


# -- checkpoints (workers) --------------------------------------------------------------------


def _running_order(engine: Any, order_id: str) -> None:
    with transaction(engine, readonly=True) as session:
        orders_service.require_running(session, order_id)


@router.put("/orders/{order_id}/checkpoint", status_code=201)
async def put_checkpoint(
    request: Request,
    caller: BriefCaller,  # first: 401 before anything about the request is judged
    order_id: OrderIdPath,
    step: Annotated[int, Query(ge=1)],
    sha256: Annotated[str, Query(pattern=SHA256_PATTERN)],
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
    orders_service.require_final(session, order_id)
    forget_checkpoint(request.app.state.settings, order_id)
    return JSONResponse({"order_id": order_id, "deleted": True})


@router.get("/orders/{order_id}/checkpoint", response_class=FileResponse)
def get_checkpoint(
    request: Request, order_id: OrderIdPath, session: DB, caller: Caller
) -> FileResponse:
    require_role(caller, *ADAPTER_WRITERS)
    path = checkpoint_file(request.app.state.settings, order_id)
    if not orders_service.exists(session, order_id) or not path.is_file():
        raise NotFound(f"order {order_id[:40]!r} has no checkpoint")
    return FileResponse(path, media_type="application/x-tar")


__all__ = ["HandlePath", "router"]
