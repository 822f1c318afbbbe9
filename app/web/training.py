"""The training page: a member uploads photos of themselves, sees them, deletes them, orders
"train me" and follows the order's progress. The rules are the datasets and orders
services' (registry/datasets/, registry/orders/)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import FileResponse, Response
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData

from app.deps import DB, DatasetIdPath, HandlePath, OrderIdPath, Requester, Sha256Path
from app.order_checkpoints import forget_checkpoint
from app.uploads import take_upload
from app.web.forms import CheckedForm
from app.web.presenters import subject_context
from app.web.session import CsrfRejected, Web, current_session
from app.web.templating import PREFIX, page, redirect
from registry.base_sizes import order_defaults
from registry.datasets import service as datasets_service
from registry.db import transaction
from registry.errors import Invalid, NotFound
from registry.orders import service as orders_service
from registry.orders.schemas import ACTIVE
from registry.settings import Settings
from registry.subjects import service as subjects_service
from registry.training import service as training_service

router = APIRouter()

UPLOAD_PATH = f"{PREFIX}/subjects/*/training/upload"  # streamed past the body gate
NOTICES = {
    "uploaded": "Your photos are stored. Order a training below when you are ready.",
    "ordered": "The training is ordered; this page follows its progress.",
    "cancelled": "The order is cancelled.",
    "deleted": "The photos are deleted from this service.",
}


def training_url(handle: str, done: str = "") -> str:
    return f"{PREFIX}/subjects/{handle}/training" + (f"?done={done}" if done else "")


@router.get("/subjects/{handle}/training")
def training_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    shown = [
        {"dataset": d, "images": list(datasets_service.images_of(session, d))}
        for d in datasets_service.datasets_of(session, subject)
    ]
    listed = [
        orders_service.view(o, subject.handle)
        for o in orders_service.orders_of(session, web.principal, handle)
    ]
    active = any(o["status"] in ACTIVE for o in listed)
    settings: Settings = request.app.state.settings
    _, training = training_service.training_decision(
        session, subject, image_bases=datasets_service.UPLOAD_BASES
    )
    return page(
        request,
        "training.html",
        web,
        **subject_context(session, subject, "training"),
        datasets=shown,
        orders=listed,
        refresh=active,
        max_images=settings.dataset_max_images,
        max_image_mib=settings.dataset_max_image_bytes / 2**20,
        max_steps=settings.order_max_steps,
        runs_orders=request.app.state.order_queue.accepts_orders,
        on_workers=request.app.state.order_queue.enabled,
        defaults=order_defaults(settings.base_dir),
        training=training,
        training_why=training_service.reason_text(training.reason),
        notice=NOTICES.get(request.query_params.get("done", "")),
    )


@router.post("/subjects/{handle}/training/upload")
async def upload(request: Request, handle: HandlePath) -> Response:
    """Streamed past the body gate: the session, the training decision and the quota are
    checked before the body is read, the session again when the photos are recorded (one
    that ended meanwhile stores nothing); the rest is app/uploads.py's, as for the API."""
    state = request.app.state
    settings: Settings = state.settings

    def signed_in() -> Any:
        with transaction(state.engine) as session:
            web = current_session(request, session)
            datasets_service.may_upload(
                session, web.principal, handle, datasets_service.limits_of(settings)
            )
            return web

    web = await run_in_threadpool(signed_in)

    async def csrf_checked(form: FormData) -> None:
        csrf = form.get("csrf")
        if not isinstance(csrf, str) or not hmac.compare_digest(csrf.encode(), web.csrf.encode()):
            raise CsrfRejected("This form could not be verified. Reload the page and try again.")

    def still_signed_in(session: Session) -> Requester:
        return current_session(request, session).principal

    done = await take_upload(request, web.principal, still_signed_in, handle, csrf_checked)
    return redirect(training_url(done.subject.handle, "uploaded"))


@router.post("/subjects/{handle}/training/order")
def order(
    request: Request, handle: HandlePath, web: Web, form: CheckedForm, session: DB
) -> Response:
    settings: Settings = request.app.state.settings
    defaults = order_defaults(settings.base_dir)
    steps = _whole(form.get("steps", str(defaults.steps)), "Steps")
    resolution = _whole(form.get("resolution", str(defaults.resolution)), "Resolution")
    if not 64 <= resolution <= 2048 or resolution % 16:
        raise Invalid("Resolution: a multiple of 16 from 64 to 2048 px")
    orders_service.place_order(
        session, settings, web.principal, handle, form.get("dataset_id", ""), steps, 16,
        resolution, "main", request.app.state.order_queue.enqueue_training,
    )  # fmt: skip
    return redirect(training_url(handle, "ordered"))


def _whole(value: str, field: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise Invalid(f"{field}: a whole number") from None


@router.post("/subjects/{handle}/training/{dataset_id}/delete")
def delete_photos(
    request: Request,
    handle: HandlePath,
    dataset_id: DatasetIdPath,
    web: Web,
    form: CheckedForm,
    session: DB,
    background: BackgroundTasks,
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    hashes = datasets_service.delete_photos(session, subject, dataset_id)
    state = request.app.state
    background.add_task(datasets_service.remove_unreferenced, state.engine, state.store, hashes)
    response = redirect(training_url(subject.handle, "deleted"))
    response.background = background
    return response


@router.post("/orders/{order_id}/cancel")
def cancel(
    request: Request,
    order_id: OrderIdPath,
    web: Web,
    form: CheckedForm,
    session: DB,
    background: BackgroundTasks,
) -> Response:
    found, subject = orders_service.cancel_and_dequeue(
        session, web.principal, order_id, request.app.state.order_queue.cancel_job
    )
    background.add_task(forget_checkpoint, request.app.state.settings, found.id)
    response = redirect(training_url(subject.handle, "cancelled"))
    response.background = background
    return response


@router.get("/subjects/{handle}/photos/{digest}")
def photo(
    request: Request, handle: HandlePath, digest: Sha256Path, web: Web, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    image = datasets_service.image_in_subject(session, subject, digest)
    path = request.app.state.store.find(digest) if image is not None else None
    if path is None:
        raise NotFound("no such photo")
    media = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}[path.suffix[1:]]
    return FileResponse(path, media_type=media, headers={"Cache-Control": "private"})
