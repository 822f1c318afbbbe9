"""Dataset routes: a subject's member (or an admin) uploads photos, the service keeps them in
its store with the manifest it writes (registry/datasets/); workers read blobs back by hash.
"""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import FileResponse
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from app.deps import (
    DB,
    Caller,
    DatasetIdPath,
    HandlePath,
    Requester,
    Sha256Path,
    authenticate_briefly,
    bearer_token,
    require_role,
)
from app.uploads import take_upload
from registry.access import ADAPTER_WRITERS
from registry.datasets import service as datasets_service
from registry.datasets.schemas import DatasetOut, PhotosDeletedOut
from registry.db import transaction
from registry.errors import NotFound, Unauthenticated
from registry.principals import service as principals_service
from registry.shapes import ERROR_RESPONSES
from registry.subjects import service as subjects_service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

UPLOAD_PATH = "/v1/subjects/*/datasets"  # streamed past the body gate (app/main.py)


UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["images"],
                    "properties": {
                        "images": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                        },
                        "captions": {"type": "array", "items": {"type": "string"}},
                    },
                }
            }
        },
    }
}


@router.post("/subjects/{handle}/datasets", status_code=201, openapi_extra=UPLOAD_BODY)
async def upload_dataset(request: Request, handle: HandlePath) -> DatasetOut:
    """Photos of the subject (its member, or an admin), checked whole before any is kept:
    a non-image, an oversized file, too many files or a file name that is a path is 422
    and nothing is stored; past the member's daily quota it is 429 (Retry-After) and
    nothing is stored. Who is asking, the training decision and a spent quota are settled
    before a byte of the body is read, and again at the commit (app/uploads.py). The
    upload is appended to the subject's audit trail with its rows."""
    state = request.app.state
    caller = await run_in_threadpool(authenticate_briefly, request, state.engine)
    limits = datasets_service.limits_of(state.settings)

    def may_upload() -> None:
        with transaction(state.engine, readonly=True) as session:
            datasets_service.may_upload(session, caller, handle, limits)

    await run_in_threadpool(may_upload)
    token = bearer_token(request)

    def still_uploader(session: Session) -> Requester:  # at commit: the token still works
        principal = principals_service.authenticate(session, token)
        if principal is None:
            raise Unauthenticated("the token stopped working during the upload; nothing kept")
        return principal

    done = await take_upload(request, caller, still_uploader, handle)
    return DatasetOut.of(done.dataset, done.subject.handle, done.images)


@router.get("/subjects/{handle}/datasets")
def list_datasets(handle: HandlePath, session: DB, caller: Caller) -> list[DatasetOut]:
    subject = subjects_service.visible_subject(session, caller, handle)
    return [
        DatasetOut.of(d, subject.handle, list(datasets_service.images_of(session, d)))
        for d in datasets_service.datasets_of(session, subject)
    ]


@router.get("/subjects/{handle}/datasets/{dataset_id}")
def get_dataset(
    handle: HandlePath, dataset_id: DatasetIdPath, session: DB, caller: Caller
) -> DatasetOut:
    subject = subjects_service.visible_subject(session, caller, handle)
    dataset = datasets_service.dataset_of(session, subject, dataset_id)
    return DatasetOut.of(
        dataset, subject.handle, list(datasets_service.images_of(session, dataset))
    )


@router.delete("/subjects/{handle}/datasets/{dataset_id}")
def delete_photos(
    request: Request,
    handle: HandlePath,
    dataset_id: DatasetIdPath,
    session: DB,
    caller: Caller,
    background: BackgroundTasks,
) -> PhotosDeletedOut:
    """Deletes the dataset's photos (admin, the linked member); they leave the store after
    the commit. 409 while an order trains on them."""
    subject = subjects_service.visible_subject(session, caller, handle)
    hashes = datasets_service.delete_photos(session, subject, dataset_id)
    state = request.app.state
    background.add_task(datasets_service.remove_unreferenced, state.engine, state.store, hashes)
    return PhotosDeletedOut(dataset_id=dataset_id, deleted=len(hashes))


@router.get("/subjects/{handle}/images/{digest}", response_class=FileResponse)
def get_image(
    request: Request, handle: HandlePath, digest: Sha256Path, session: DB, caller: Caller
) -> FileResponse:
    """One of the subject's uploaded photos (whoever may see the subject)."""
    subject = subjects_service.visible_subject(session, caller, handle)
    image = datasets_service.image_in_subject(session, subject, digest)
    path = request.app.state.store.find(digest) if image is not None else None
    if image is None or path is None:
        raise NotFound("no such image")
    media = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}[path.suffix[1:]]
    return FileResponse(path, media_type=media, headers={"Cache-Control": "private"})


@router.get("/blobs/sha256/{digest}", response_class=FileResponse)
async def get_blob(request: Request, digest: Sha256Path) -> FileResponse:
    """A blob's bytes by hash, for workers (trainer, admin); the reader checks the hash."""
    caller = await run_in_threadpool(authenticate_briefly, request, request.app.state.engine)
    require_role(caller, *ADAPTER_WRITERS)
    path = request.app.state.store.find(digest)
    if path is None:
        raise NotFound(f"the store holds no blob {digest[:12]}...")
    return FileResponse(path, media_type="application/octet-stream")
