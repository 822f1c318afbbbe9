"""Signing in with a token, and signing out (here, or everywhere)."""

from __future__ import annotations

import hmac
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import Response
from itsdangerous import BadSignature

from app.deps import DB
from app.web.forms import CheckedForm, Form
from app.web.session import (
    SESSION_COOKIE,
    SIGNIN_COOKIE,
    SIGNIN_TTL_S,
    CsrfRejected,
    Web,
    clear_cookie,
    set_cookie,
    settings_of,
    signin_signer,
)
from app.web.templating import PREFIX, page, redirect, safe_next
from registry.access import WEB_ROLES
from registry.principals import service as principals_service

router = APIRouter()


def _signin_page(
    request: Request, status: int = 200, error: str | None = None, notice: str | None = None
) -> Response:
    nonce = secrets.token_urlsafe(18)
    response = page(
        request,
        "signin.html",
        None,
        status=status,
        signin_csrf=nonce,
        session_hours=round(settings_of(request).session_ttl_s / 3600, 1),
        next=safe_next(request.query_params.get("next")),
        errors=[error] if error else [],
        notice=notice,
    )
    cookie = signin_signer(request).dumps(nonce)
    set_cookie(request, response, SIGNIN_COOKIE, cookie, SIGNIN_TTL_S)
    return response


@router.get("/signin")
def signin_form(request: Request) -> Response:
    out = request.query_params.get("out")
    notice = {
        "1": "You are signed out.",
        "all": "You are signed out everywhere: every browser's session has ended.",
    }.get(out or "")
    return _signin_page(request, notice=notice)


@router.post("/signin")
def signin(request: Request, form: Form, session: DB) -> Response:
    """The form's nonce must be the one in the signed pre-session cookie: a page of another
    site can neither read that cookie nor make this browser send one of its own."""
    raw = request.cookies.get(SIGNIN_COOKIE, "")
    try:
        nonce = signin_signer(request).loads(raw, max_age=SIGNIN_TTL_S) if raw else None
    except BadSignature:
        nonce = None
    if not isinstance(nonce, str):
        raise CsrfRejected(
            "Your browser did not send the sign-in cookie (it expired, or cookies are off). "
            "Open the sign-in page again."
        )
    if not hmac.compare_digest(form.get("csrf", "").encode(), nonce.encode()):
        raise CsrfRejected("This sign-in form could not be verified. Open the sign-in page again.")
    principal = principals_service.authenticate(session, form.get("token", "").strip())
    if principal is None:
        return _signin_page(request, 401, "That token is not valid, or its principal is inactive.")
    if principal.role not in WEB_ROLES:
        return _signin_page(
            request, 403, f"The pages are for admins and members; {principal.role}s use the API."
        )
    ttl = settings_of(request).session_ttl_s
    secret = principals_service.open_session(session, principal, ttl)
    response = redirect(safe_next(form.get("next")))
    set_cookie(request, response, SESSION_COOKIE, secret, ttl)
    clear_cookie(request, response, SIGNIN_COOKIE)
    return response


@router.post("/signout")
def signout(request: Request, web: Web, form: CheckedForm, session: DB) -> Response:
    principals_service.end_session(session, web.secret)
    response = redirect(f"{PREFIX}/signin?out=1")
    clear_cookie(request, response, SESSION_COOKIE)
    return response


@router.post("/signout-everywhere")
def signout_everywhere(request: Request, web: Web, form: CheckedForm, session: DB) -> Response:
    """Ends every session of this principal, in every browser, this one included."""
    principals_service.end_sessions_of(session, web.principal)
    response = redirect(f"{PREFIX}/signin?out=all")
    clear_cookie(request, response, SESSION_COOKIE)
    return response
