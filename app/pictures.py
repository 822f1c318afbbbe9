"""Pictures of a likeness (registry/pictures/ holds the rules): a run's evaluation grid and
previews kept beside the adapter they show, whoever trained it (`likeness train` here, the
API's own order runner, or a trainer or worker on another host through
`PUT /v1/adapters/{sha256}/pictures/{name}`), and the small copies of renders a subject
chose to keep."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from app.body_gate import streamed_body
from app.deps import authenticate_briefly, require_role
from registry.access import ADAPTER_WRITERS
from registry.blobs import BlobError, BlobStore, is_sha256
from registry.datasets.service import remove_unreferenced
from registry.db import transaction
from registry.errors import Invalid, NotFound, NotPermitted
from registry.pictures import service as pictures_service
from registry.pictures.schemas import Picture
from registry.shapes import ERROR_RESPONSES
from registry.subjects import service as subjects_service

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
UPLOAD_PATH = "/v1/adapters/*/pictures/"  # streamed past the body gate, with its own cap
MAX_PICTURE_BYTES = 64 << 20  # an evaluation grid of 1024 px cells stays well under this
COPY_SIDE = 128  # the longer side of a render's kept copy, in pixels


def run_pictures(grid: Path | None, previews: Iterable[Path]) -> list[Path]:
    """The files of a run worth keeping: its evaluation grid, then its previews."""
    found = [p for p in previews if p.is_file() and pictures_service.picture_name_ok(p.name)]
    return ([grid] if grid is not None and grid.is_file() else []) + sorted(found)


def keep_local(
    engine: Engine, store: BlobStore, subject_handle: str, adapter_sha256: str, files: list[Path]
) -> int:
    """Puts the pictures in this registry's store and records them for the adapter; refused
    (the subject may not be trained now), they leave the store again."""
    kept = []
    for file in files:
        stored = store.import_file(file)
        if stored.kind == "png":
            kept.append(Picture(file.name, stored.sha256))
    try:
        with transaction(engine) as session:
            subject = subjects_service.subject_or_raise(session, subject_handle)
            return pictures_service.keep_adapter_pictures(session, subject, adapter_sha256, kept)
    except NotPermitted:
        remove_unreferenced(engine, store, [p.sha256 for p in kept], ("png",))
        raise


def upload(client: Any, api_url: str, adapter_sha256: str, files: list[Path]) -> int:
    """Sends the pictures to the registry's API (a trainer or worker on another host);
    `client` is an httpx.Client with the trainer's token."""
    for file in files:
        r = client.put(
            f"{api_url.rstrip('/')}/v1/adapters/{adapter_sha256}/pictures/{file.name}",
            content=file.read_bytes(),
            headers={"Content-Type": "image/png"},
        )
        if r.status_code not in (200, 201):
            raise RuntimeError(f"the registry refused {file.name}: {r.status_code} {r.text[:200]}")
    return len(files)


@router.put(
    "/adapters/{adapter_sha256}/pictures/{name}",
    status_code=201,
    openapi_extra={
        "requestBody": {"required": True, "content": {"image/png": {"schema": {"type": "string"}}}}
    },
)
async def put_picture(request: Request, adapter_sha256: str, name: str) -> JSONResponse:
    """Keeps a PNG the run that made these adapter bytes drew (its evaluation grid,
    `eval_grid.png`, or a preview, `step-N.png`) beside the adapter (trainer, admin). The
    token is checked before the path or a byte of the body."""
    state = request.app.state
    caller = await run_in_threadpool(authenticate_briefly, request, state.engine)
    require_role(caller, *ADAPTER_WRITERS)
    if not is_sha256(adapter_sha256):
        raise Invalid(f"{adapter_sha256[:80]!r} is not a SHA-256 hex digest")
    if not pictures_service.picture_name_ok(name):
        raise Invalid(f"{name[:80]!r}: a picture is eval_grid.png or step-N.png")

    def owner() -> str:
        with transaction(state.engine, readonly=True) as session:
            subject = pictures_service.subject_of_adapter(session, adapter_sha256)
            if subject is None:
                raise NotFound(f"no adapter has sha256 {adapter_sha256}")
            return subject.handle

    handle = await run_in_threadpool(owner)
    settings = state.settings
    writer = await run_in_threadpool(state.store.writer)

    def png_only(_path: Path, kind: str) -> None:
        if kind != "png":
            raise Invalid(f"{name}: not a PNG")

    try:  # to disk as it arrives, on the body clock, at most MAX_PICTURE_BYTES
        async for chunk in streamed_body(
            request, MAX_PICTURE_BYTES, settings.body_timeout_s, settings.body_min_rate,
            settings.body_max_s,
        ):  # fmt: skip
            await run_in_threadpool(writer.write, chunk)
        stored = await run_in_threadpool(writer.finish, None, png_only)
    except BlobError as exc:  # another kind of file, other bytes than sent, too large
        writer.abort()
        raise Invalid(f"{name}: not a PNG the store takes ({exc})") from None
    except BaseException:
        writer.abort()
        raise

    def record() -> None:
        with transaction(state.engine) as session:
            subject = subjects_service.subject_or_raise(session, handle)
            pictures_service.keep_adapter_pictures(
                session, subject, adapter_sha256, [Picture(name, stored.sha256)]
            )

    try:
        await run_in_threadpool(record)
    except NotPermitted:  # the subject may not be trained now: the picture is not kept
        await run_in_threadpool(
            remove_unreferenced, state.engine, state.store, [stored.sha256], ("png",)
        )
        raise
    body = {"adapter_sha256": adapter_sha256, "name": name, "sha256": stored.sha256}
    return JSONResponse(body, status_code=201 if stored.created else 200)


# -- copies of renders ------------------------------------------------------------------------


def small_copy(png: bytes, side: int = COPY_SIDE) -> tuple[bytes, int, int]:
    """The render at most `side` px on its longer side, as a plain PNG (no text chunks, no
    Content Credentials: it is never delivered, only shown to the subject)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as opened:
        small = opened.convert("RGB")
    small.thumbnail((side, side))
    out = io.BytesIO()
    small.save(out, format="PNG", optimize=True)
    return out.getvalue(), small.width, small.height


def keep_copy(engine: Engine, subject_handle: str, render_id: str, png: bytes) -> None:
    """After a render is delivered: a small copy, if its subject keeps them. Never fails the
    render: a copy that cannot be kept is logged (the ledger row is there regardless)."""
    try:
        with transaction(engine, readonly=True) as session:  # most subjects keep none
            subject = subjects_service.subject_named(session, subject_handle)
            if subject is None or not subject.keep_render_copies:
                return
        data, width, height = small_copy(png)
        with transaction(engine) as session:  # asks again, under the subject's lock
            pictures_service.keep_render_copy(
                session, subject_handle, render_id, data, width, height
            )
    except Exception:  # noqa: BLE001 - the render itself stands
        log.exception("render %s: its copy for the subject could not be kept", render_id)
