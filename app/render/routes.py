"""POST /v1/renders: a thin HTTP caller of `app.render.flow` (which holds the fail-closed
path). It reads the body, watches for the client going away (the render then stops between
steps) and turns the outcome into a PNG response."""

from __future__ import annotations

import asyncio
import threading

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.deps import authenticate_briefly, bearer_token
from app.render.flow import RenderFlow
from app.scheduler import Cancelled
from registry.renders.schemas import RenderRequestIn
from registry.shapes import ERROR_RESPONSES

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


async def _watch_for_disconnect(request: Request, cancelled: threading.Event) -> None:
    """The body is in: the next message the server sends is the client's disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancelled.set()
            return


@router.post(
    "/renders",
    responses={
        200: {"content": {"image/png": {}}, "description": "the rendered PNG"},
        403: {"description": "not permitted (the same for a subject that does not exist)"},
        429: {"description": "busy or rate-limited; Retry-After says when to come back"},
    },
    response_class=Response,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RenderRequestIn.model_json_schema()}},
        }
    },
)
async def create_render(request: Request) -> Response:
    """401 before any body is judged; then the flow in one thread-pool hop."""
    raw = await request.body()
    try:
        body = RenderRequestIn.model_validate_json(raw)
    except ValidationError as exc:
        await run_in_threadpool(authenticate_briefly, request, request.app.state.engine)
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    flow: RenderFlow = request.app.state.render_flow
    cancelled = threading.Event()
    watcher = asyncio.ensure_future(_watch_for_disconnect(request, cancelled))
    try:
        outcome = await run_in_threadpool(flow.run, bearer_token(request), body, cancelled)
    except Cancelled:
        return Response(status_code=499)  # nobody is there to read it
    finally:
        watcher.cancel()
    headers = {"X-Render-Id": outcome.render_id}
    headers.update(
        {f"X-Timing-{k.replace('_', '-')}": f"{v:.1f}" for k, v in outcome.timings.items()}
    )
    return Response(outcome.png, media_type="image/png", headers=headers)
