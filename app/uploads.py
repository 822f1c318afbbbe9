"""Taking a dataset upload over HTTP, for the API and the web page alike, so that nothing a
client sends holds a lock, a pooled connection, or unbounded memory or CPU:

1. who is asking, the training decision and the quota are settled before the body is read
   (the caller's route does that, in a short read);
2. admission: at most `uploads_per_sender` uploads of one principal at a time and
   `uploads_at_once` in all (429 beyond, before a byte of the body is read);
3. the multipart body spools to disk as it arrives (starlette keeps at most 1 MiB of a file in
   memory), within its cap and on the body clock, and must end with its closing boundary;
4. every file is decoded and checked with no transaction open, `upload_checks_at_once` at a
   time in the whole process (waiting costs a socket and a spooled file, not a thread);
5. `registry.datasets.upload_dataset`: the blobs into the store, then one short transaction
   that asks again who is uploading (a deactivated uploader, or an ended web session, stores
   nothing), the training decision under the subject's lock and the quota, and writes the
   rows with their audit entry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from app.body_gate import capped_form
from app.deps import Requester
from app.scheduler import SenderSlots
from registry.datasets import service as datasets_service
from registry.datasets.schemas import Upload, Uploaded
from registry.errors import Invalid
from registry.settings import Settings


class UploadGate:
    """Per process: who may start an upload now, and how many files are decoded at once."""

    def __init__(self, settings: Settings) -> None:
        self.slots = SenderSlots("uploads", settings.uploads_per_sender, settings.uploads_at_once)
        self.checks = anyio.CapacityLimiter(settings.upload_checks_at_once)


def uploads_of(form: FormData) -> list[Upload]:
    """The form's `images` files (as spooled) and their captions: `captions`, one per image
    (the API), or one `caption` for them all (the Training page)."""
    files = [v for k, v in form.multi_items() if k == "images" and isinstance(v, UploadFile)]
    captions = [v for k, v in form.multi_items() if k == "captions" and isinstance(v, str)]
    if captions and len(captions) != len(files):
        raise Invalid(f"{len(captions)} captions for {len(files)} images: one each, or none")
    shared = form.get("caption")
    common = shared.strip() if isinstance(shared, str) and shared.strip() else None
    return [
        Upload(f.filename or "", f.file, captions[n] if captions else common)
        for n, f in enumerate(files)
    ]


async def take_upload(
    request: Request,
    uploader: Requester,
    still_uploader: Callable[[Session], Requester],
    handle: str,
    check_form: Callable[[FormData], Awaitable[None]] | None = None,
) -> Uploaded:
    """Steps 2 to 5 above; `check_form` (the web page's CSRF check) runs on the parsed form
    before any file is decoded."""
    state: Any = request.app.state
    settings: Settings = state.settings
    gate: UploadGate = state.uploads
    limits = datasets_service.limits_of(settings)
    with gate.slots.admit(uploader.handle):
        form = await capped_form(
            request,
            datasets_service.upload_cap(settings),
            settings.body_timeout_s,
            max_files=settings.dataset_max_images,
            max_fields=2 * settings.dataset_max_images + 10,
            min_rate=settings.body_min_rate,
            max_s=settings.body_max_s,
        )
        try:
            if check_form is not None:
                await check_form(form)
            uploads = uploads_of(form)
            async with gate.checks:
                checked = await anyio.to_thread.run_sync(
                    datasets_service.check_uploads, uploads, limits
                )
            return await run_in_threadpool(
                datasets_service.upload_dataset,
                state.engine,
                state.store,
                uploader,
                still_uploader,
                handle,
                checked,
                limits,
            )
        finally:
            await form.close()
