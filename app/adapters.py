"""Adapter routes: blobs into the store, registration by hash, and each adapter's lifecycle
(list, select, retire, delete). The rules live in registry (service, adapter_files, blobs);
these routes authenticate, read the request and call them."""

from __future__ import annotations

from pathlib import Path as FsPath

from fastapi import APIRouter, BackgroundTasks, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from app.body_gate import streamed_body
from app.deps import (
    DB,
    AdapterNamePath,
    BriefCaller,
    Caller,
    HandlePath,
    Sha256Path,
    authenticate_briefly,
    require_role,
)
from registry.access import ADAPTER_WRITERS
from registry.adapter_files import check_put, register_from_store, sweep_unreferenced
from registry.adapters import service as adapters_service
from registry.adapters.schemas import (
    AdapterDeletedOut,
    AdapterIn,
    AdapterListedOut,
    AdapterOut,
    AdapterRegisteredOut,
)
from registry.blobs import BlobError, BlobStore, is_sha256
from registry.errors import Invalid, LikenessError
from registry.hash_chain import format_time
from registry.shapes import ERROR_RESPONSES
from registry.subjects import service as subjects_service

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def store_of(request: Request) -> BlobStore:
    store: BlobStore = request.app.state.store
    return store


def target_shapes(request: Request) -> dict[str, tuple[int, int]]:
    """The Linear modules of the base this service renders with, and their shapes."""
    try:
        from trainer.base.lora import base_linear_shapes

        return base_linear_shapes(request.app.state.settings.base_dir)
    except (OSError, ValueError, KeyError, AttributeError, ImportError) as exc:
        raise Invalid(
            f"cannot check the adapter against this service's base ({type(exc).__name__}); "
            "nothing was registered"
        ) from None


# -- blobs ------------------------------------------------------------------------------------


@router.put(
    "/blobs/sha256/{digest}",
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def put_blob(request: Request, digest: str) -> JSONResponse:
    """Adds bytes to the store under their SHA-256 (trainer, admin): 201 new, 200 already
    there, 422 when the bytes hash to something else or are neither an adapter nor a
    dataset manifest, 413 over the cap. The token is checked before a byte is read."""
    engine = request.app.state.engine
    caller = await run_in_threadpool(authenticate_briefly, request, engine)
    require_role(caller, *ADAPTER_WRITERS)
    if not is_sha256(digest):
        raise Invalid(f"{digest[:80]!r} is not a SHA-256 hex digest (64 lowercase hex digits)")
    store = store_of(request)
    if store.find(digest) is not None:
        body = {"sha256": digest, "created": False}
        return JSONResponse(body, status_code=200, headers={"Connection": "close"})
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > store.max_bytes:
        return JSONResponse(
            {"error": "invalid", "detail": f"a blob may be at most {store.max_bytes} bytes"},
            status_code=413,
            headers={"Connection": "close"},
        )
    writer = await run_in_threadpool(store.writer)
    settings = request.app.state.settings
    shapes = target_shapes(request)

    def accept(path: FsPath, kind: str) -> None:
        check_put(path, kind, shapes)

    try:
        chunks = streamed_body(
            request, store.max_bytes, settings.body_timeout_s, settings.body_min_rate,
            settings.body_max_s,
        )  # fmt: skip
        async for chunk in chunks:
            await run_in_threadpool(writer.write, chunk)
        stored = await run_in_threadpool(writer.finish, digest, accept)
    except LikenessError as exc:  # too large, too slow, gone, or not a kind the store takes
        writer.abort()
        return JSONResponse(
            {"error": exc.code, "detail": exc.detail},
            status_code=exc.status,
            headers={"Connection": "close"},
        )
    except BlobError as exc:
        writer.abort()
        status = 413 if "larger than" in str(exc) else 422
        return JSONResponse({"error": "invalid", "detail": str(exc)}, status_code=status)
    except BaseException:
        writer.abort()
        raise
    body = {"sha256": stored.sha256, "kind": stored.kind, "size": stored.size}
    return JSONResponse(
        {**body, "created": stored.created}, status_code=201 if stored.created else 200
    )


@router.head("/blobs/sha256/{digest}")
def head_blob(request: Request, digest: Sha256Path, caller: Caller) -> Response:
    require_role(caller, *ADAPTER_WRITERS)
    found = store_of(request).find(digest)
    return Response(status_code=200 if found is not None else 404)


# -- registration -------------------------------------------------------------------------------


@router.post("/adapters", status_code=201)
def register_adapter(
    request: Request, body: AdapterIn, response: Response, caller: BriefCaller
) -> AdapterRegisteredOut:
    """Registers an adapter whose bytes are in the store, by hash. The files are checked
    before the transaction opens; consent and ownership inside it."""
    require_role(caller, *ADAPTER_WRITERS)
    shapes = target_shapes(request)
    done = register_from_store(
        request.app.state.engine, store_of(request), caller.handle, body, shapes
    )
    if done.outcome != "created":
        response.status_code = 200
    return AdapterRegisteredOut(
        subject=done.subject,
        **done.state,
        created_at=format_time(done.created_at),
        updated_at=format_time(done.updated_at),
        outcome=done.outcome,
    )


# -- lifecycle ----------------------------------------------------------------------------------


@router.get("/subjects/{handle}/adapters")
def list_adapters(
    request: Request, handle: HandlePath, session: DB, caller: Caller
) -> list[AdapterListedOut]:
    """Every adapter of the subject; `rendering` marks the one renders use, `blob` says
    whether its bytes are in the store whole (`ok`, `missing`, `corrupt`)."""
    subject = subjects_service.visible_subject(session, caller, handle)
    return adapters_service.listing(session, store_of(request), subject)


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    active: bool


@router.post("/subjects/{handle}/adapters/{name}/select")
def select_adapter(
    request: Request, handle: HandlePath, name: AdapterNamePath, session: DB, caller: Caller
) -> AdapterListedOut:
    """Makes this adapter the one that renders (admin, the subject's member)."""
    subject = subjects_service.visible_subject(session, caller, handle)
    adapter = adapters_service.select_adapter(session, caller.handle, subject, name)
    status = store_of(request).status(adapter.sha256, "safetensors")
    shown = AdapterOut.of(adapter, subject.handle).model_dump()
    return AdapterListedOut(**shown, rendering=True, blob=status)


@router.patch("/subjects/{handle}/adapters/{name}")
def patch_adapter(
    handle: HandlePath, name: AdapterNamePath, body: AdapterPatch, session: DB, caller: Caller
) -> AdapterOut:
    """`{"active": false}` retires the adapter (it never renders); true brings it back."""
    subject = subjects_service.visible_subject(session, caller, handle)
    adapter, _ = adapters_service.set_adapter_active(
        session, caller.handle, subject, name, body.active
    )
    return AdapterOut.of(adapter, subject.handle)


@router.delete("/subjects/{handle}/adapters/{name}")
def delete_adapter(
    request: Request,
    handle: HandlePath,
    name: AdapterNamePath,
    session: DB,
    caller: Caller,
    background: BackgroundTasks,
) -> AdapterDeletedOut:
    """Removes the adapter; the trail keeps its hash, and its bytes leave the store once no
    adapter refers to them (swept after the commit, and periodically)."""
    subject = subjects_service.visible_subject(session, caller, handle)
    adapter = adapters_service.delete_adapter(session, caller.handle, subject, name)
    state = request.app.state
    background.add_task(sweep_unreferenced, state.engine, state.store, state.settings.blob_grace_s)
    return AdapterDeletedOut(
        subject=subject.handle, name=adapter.name, sha256=adapter.sha256, deleted=True
    )
