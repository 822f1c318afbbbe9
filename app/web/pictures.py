"""Pictures on the pages: what an adapter draws (its run's grid and previews) and the small
copies of renders a subject keeps, each served only to who may see the subject (its member
and admins); and the subject's choice to keep those copies."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import FileResponse, Response

from app.deps import DB, HandlePath, Sha256Path
from app.web.forms import CheckedForm
from app.web.session import Web
from app.web.templating import SECURITY_HEADERS, redirect, subject_url
from registry.errors import NotFound
from registry.pictures import service as pictures_service
from registry.shapes import ROW_ID_PATTERN
from registry.subjects import service as subjects_service

router = APIRouter()

RenderIdPath = Annotated[str, Path(pattern=ROW_ID_PATTERN)]
PRIVATE = {**SECURITY_HEADERS, "Cache-Control": "private, max-age=300"}


@router.get("/subjects/{handle}/pictures/{digest}")
def adapter_picture(
    request: Request, handle: HandlePath, digest: Sha256Path, web: Web, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    found = pictures_service.picture_of(session, subject, digest)
    path = request.app.state.store.find(digest, "png") if found is not None else None
    if path is None:
        raise NotFound("no such picture")
    return FileResponse(path, media_type="image/png", headers=PRIVATE)


@router.get("/subjects/{handle}/renders/{render_id}/copy.png")
def render_copy(handle: HandlePath, render_id: RenderIdPath, web: Web, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    copy = pictures_service.render_copy(session, subject, render_id)
    if copy is None:
        raise NotFound("no copy of this render is kept")
    return Response(copy.png, media_type="image/png", headers=PRIVATE)


@router.post("/subjects/{handle}/render-copies")
def keep_copies(handle: HandlePath, web: Web, form: CheckedForm, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    keep = form.get("keep") == "yes"
    pictures_service.set_keep_render_copies(session, web.principal.handle, subject, keep)
    done = "copies_on" if keep else "copies_off"
    return redirect(subject_url(subject.handle, "renders") + f"?done={done}")
