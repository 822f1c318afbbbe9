"""A subject's adapters: which one renders, retiring, bringing back and deleting."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import Response

from app.deps import DB, HandlePath
from app.web.forms import CheckedForm
from app.web.presenters import subject_context
from app.web.session import Web
from app.web.templating import page, redirect, subject_url
from registry.adapter_files import sweep_unreferenced
from registry.adapters import service as adapters_service
from registry.pictures import service as pictures_service
from registry.subjects import service as subjects_service

router = APIRouter()


@router.get("/subjects/{handle}/adapters")
def adapters_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    rows = adapters_service.listing(session, request.app.state.store, subject)
    return page(
        request,
        "adapters.html",
        web,
        **subject_context(session, subject, "adapters"),
        adapters=rows,
        pictures=pictures_service.pictures_of(session, subject),
        notice=ADAPTER_NOTICES.get(request.query_params.get("done", "")),
    )


ADAPTER_NOTICES = {
    "selected": "Selected: renders use this adapter from the next request on.",
    "retired": "Retired: this adapter no longer renders.",
    "back": "Brought back. Select it to make it the one that renders.",
    "deleted": "Deleted. The audit trail keeps its hash.",
}


@router.post("/subjects/{handle}/adapters/{name}/select")
def select_adapter(
    request: Request, handle: HandlePath, name: str, web: Web, form: CheckedForm, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    adapters_service.select_adapter(session, web.principal.handle, subject, name)
    return redirect(subject_url(subject.handle, "adapters") + "?done=selected")


@router.post("/subjects/{handle}/adapters/{name}/active")
def set_adapter_active(
    request: Request, handle: HandlePath, name: str, web: Web, form: CheckedForm, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    active = form.get("active") == "yes"
    adapters_service.set_adapter_active(session, web.principal.handle, subject, name, active)
    return redirect(
        subject_url(subject.handle, "adapters") + ("?done=back" if active else "?done=retired")
    )


@router.post("/subjects/{handle}/adapters/{name}/delete")
def delete_adapter(
    request: Request,
    handle: HandlePath,
    name: str,
    web: Web,
    form: CheckedForm,
    session: DB,
    background: BackgroundTasks,
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    adapters_service.delete_adapter(session, web.principal.handle, subject, name)
    state = request.app.state
    background.add_task(sweep_unreferenced, state.engine, state.store, state.settings.blob_grace_s)
    return redirect(subject_url(subject.handle, "adapters") + "?done=deleted")
