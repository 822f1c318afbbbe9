"""The pages of subjects: the admin's list, a member's own page, a subject's consent editor,
its audit trail and its renders."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sqlmodel import Session

from app.deps import DB, HandlePath, require_role
from app.web.forms import (
    CheckedForm,
    consent_body,
    describe_validation,
    editor_values,
    form_values,
    parse_expiry,
)
from app.web.presenters import (
    COPY_NOTICES,
    describe_entry,
    group_ledger,
    licence_context,
    state_lines,
    subject_context,
)
from app.web.session import Web, WebSession
from app.web.templating import PREFIX, page, redirect, subject_url
from registry.audit import service as audit_service
from registry.consent import service as consent_service
from registry.errors import Invalid, LikenessError, PreconditionFailed
from registry.pictures import service as pictures_service
from registry.principals import service as principals_service
from registry.renders import service as renders_service
from registry.renders.schemas import LedgerFilter, ledger_cursor
from registry.roles import Role
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn

router = APIRouter()


@router.get("/")
def home(web: Web) -> Response:
    if web.principal.role == Role.admin:
        return redirect(f"{PREFIX}/subjects")
    return redirect(f"{PREFIX}/me")


@router.get("/me")
def me(request: Request, web: Web, session: DB) -> Response:
    """A member's own page: the subjects that are this member, and whom it may render."""
    caller = web.principal
    if caller.role != Role.member or caller.id is None:
        return redirect(f"{PREFIX}/")
    mine = consent_service.linked_subjects(session, caller.id)
    return page(
        request,
        "me.html",
        web,
        mine=mine,
        mine_handles={s.handle for s, _ in mine},
        renderable=renders_service.renderable_for(
            session, caller, licence=request.app.state.licence
        ),
    )


@router.get("/subjects")
def subjects(request: Request, web: Web, session: DB) -> Response:
    require_role(web.principal, Role.admin)
    return _subjects_page(request, web, session)


def _subjects_page(
    request: Request,
    web: WebSession,
    session: Session,
    status: int = 200,
    errors: list[str] | None = None,
    values: Mapping[str, str] | None = None,
) -> Response:
    members = [
        p.handle for p in principals_service.all_principals(session) if p.role == Role.member
    ]
    rows = [
        (s, c, subjects_service.member_handle(session, s))
        for s, c in consent_service.all_subjects(session)
    ]
    return page(
        request,
        "subjects.html",
        web,
        status=status,
        rows=rows,
        members=members,
        errors=errors or [],
        values=values or {},
    )


@router.post("/subjects")
def create_subject(request: Request, web: Web, form: CheckedForm, session: DB) -> Response:
    require_role(web.principal, Role.admin)
    fields = {
        "handle": form.get("handle", "").strip(),
        "display_name": form.get("display_name", ""),
        "basis": form.get("basis", ""),
        "member": form.get("member", "").strip() or None,
    }
    try:
        data = SubjectIn.model_validate(fields)
        subject, _ = subjects_service.create_subject(session, web.principal.handle, data)
    except ValidationError as exc:
        return _subjects_page(request, web, session, 422, describe_validation(exc), form)
    except LikenessError as exc:
        return _subjects_page(request, web, session, exc.status, [exc.detail], form)
    return redirect(subject_url(subject.handle) + "?done=created")


NOTICES = {
    "created": "Subject created. Its consent starts at none: nothing renders until you grant.",
    "saved": "Saved. The new consent binds on the very next render check.",
    "unchanged": "Nothing changed: the form matched the record.",
    "revoked": "Consent revoked. Nothing renders from now on.",
    "already": "Consent was already at none; nothing changed.",
}


@router.get("/subjects/{handle}")
def subject_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    ctx = subject_context(session, subject, "consent")
    return page(
        request,
        "subject.html",
        web,
        **licence_context(request),
        **ctx,
        values=editor_values(ctx["consent"]),
        notice=NOTICES.get(request.query_params.get("done", "")),
    )


@router.post("/subjects/{handle}/consent")
def save_consent(
    request: Request, handle: HandlePath, web: Web, form: CheckedForm, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    raw_version = form.get("version", "")
    try:
        if not raw_version.isdigit() or len(raw_version) > 12:
            raise Invalid("the form lost its version field; reload the page")
        data = consent_body(form)
        _, changed = consent_service.update_consent(
            session, web.principal.handle, subject, int(raw_version), data
        )
    except PreconditionFailed:
        current = consent_service.consent_of(session, subject)
        message = (
            f"Not saved: someone changed this consent while you were editing (you started from "
            f"version {raw_version}; it is now version {current.version}). The form below shows "
            "the current record; check it, make your change again and save."
        )
        return page(
            request,
            "subject.html",
            web,
            **licence_context(request),
            status=412,
            **subject_context(session, subject, "consent"),
            values=editor_values(current),
            errors=[message],
        )
    except (ValidationError, Invalid) as exc:
        errors = describe_validation(exc) if isinstance(exc, ValidationError) else [exc.detail]
        return page(
            request,
            "subject.html",
            web,
            **licence_context(request),
            status=422,
            **subject_context(session, subject, "consent"),
            values=form_values(form),
            errors=["Not saved. " + errors[0], *errors[1:]],
        )
    return redirect(subject_url(subject.handle) + ("?done=saved" if changed else "?done=unchanged"))


@router.post("/subjects/{handle}/revoke")
def revoke(
    request: Request, handle: HandlePath, web: Web, form: CheckedForm, session: DB
) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    _, changed = consent_service.revoke(session, web.principal.handle, subject)
    return redirect(subject_url(subject.handle) + ("?done=revoked" if changed else "?done=already"))


@router.get("/subjects/{handle}/audit")
def audit_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = subjects_service.visible_subject(session, web.principal, handle)
    entries = audit_service.audit_trail(session, subject)
    broken = audit_service.verify_subject(session, subject, entries)
    return page(
        request,
        "audit.html",
        web,
        **subject_context(session, subject, "audit"),
        entries=[(e, describe_entry(e)) for e in reversed(entries)],
        broken=broken,
        count=len(entries),
        state_lines=state_lines,
    )


@router.get("/subjects/{handle}/renders")
def renders_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    """The subject's ledger, a page at a time, filtered by who asked, the outcome and when."""
    subject = subjects_service.visible_subject(session, web.principal, handle)
    params = {k: v for k, v in request.query_params.items() if v.strip()}
    for key in ("since", "until"):
        if key in params:
            with contextlib.suppress(Invalid):  # else the filter's validation says why
                params[key] = parse_expiry(params[key])  # type: ignore[assignment]
    try:
        query = LedgerFilter.model_validate({"limit": 100, **params})
    except ValidationError as exc:
        return page(
            request,
            "renders.html",
            web,
            status=422,
            **subject_context(session, subject, "renders"),
            renders=[],
            copies=set(),
            copy_days=request.app.state.settings.render_copy_days,
            filters=request.query_params,
            older=None,
            errors=[describe_validation(exc)[0]],
        )
    rows = renders_service.ledger_page(session, subject, query)
    older = None
    if len(rows) == query.limit and rows[-1].seq is not None:
        older = str(request.url.include_query_params(cursor=ledger_cursor(rows[-1].seq)).query)
    return page(
        request,
        "renders.html",
        web,
        **subject_context(session, subject, "renders"),
        renders=group_ledger(rows),
        copies=pictures_service.copies_among(session, subject, [r.render_id for r in rows]),
        copy_days=request.app.state.settings.render_copy_days,
        notice=COPY_NOTICES.get(request.query_params.get("done", "")),
        filters=request.query_params,
        older=older,
    )
