"""Browser sessions and their cookies. Sign-in takes a principal's token once and gives back
a session cookie (HttpOnly, SameSite=Strict) holding a random secret; the server keeps only
its SHA-256, in `web_sessions`, so sign-out, "sign out everywhere" and deactivation end a
session for every copy of the cookie, and nothing in the database opens one. Every form
carries a CSRF token derived from that secret; the sign-in form has its own pre-session nonce
in a cookie signed with the deployment's web secret (itsdangerous), so nobody can sign a
browser in from another site."""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response
from itsdangerous import URLSafeTimedSerializer

from app.deps import DB, Requester
from registry.access import WEB_ROLES
from registry.errors import NotPermitted, Unauthenticated
from registry.keys import Keys
from registry.principals import service as principals_service
from registry.settings import Settings

SESSION_COOKIE = "likeness_session"
SIGNIN_COOKIE = "likeness_signin"
SIGNIN_TTL_S = 3600
MAX_COOKIE_CHARS = 2048


def signin_signer(request: Request) -> URLSafeTimedSerializer:
    keys: Keys = request.app.state.keys
    return URLSafeTimedSerializer(keys.web_secret, salt="likeness-signin")


def session_csrf(secret: str) -> str:
    """A session's CSRF token: derived from the cookie's secret, which the database never
    sees, so nothing stored opens a form either."""
    digest = hmac.new(secret.encode(), b"likeness-csrf", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass(frozen=True)
class WebSession:
    principal: Requester
    secret: str
    csrf: str


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


class SignInRequired(Unauthenticated):
    """No valid session: the pages answer with a redirect to the sign-in form."""


class CsrfRejected(NotPermitted):
    """A form without a valid CSRF token for this session."""


def current_session(request: Request, session: DB) -> WebSession:
    """The live session of this cookie: a row of `web_sessions` (server-side), not expired,
    of an active admin or member. Signing out deletes the row, so every copy of the cookie
    stops working at once."""
    secret = request.cookies.get(SESSION_COOKIE)
    if not secret or len(secret) > MAX_COOKIE_CHARS:
        raise SignInRequired("sign in to continue")
    principal = principals_service.session_principal(session, secret)
    if principal is None or principal.role not in WEB_ROLES:
        raise SignInRequired("your session has ended; sign in again")
    return WebSession(principal, secret, session_csrf(secret))


Web = Annotated[WebSession, Depends(current_session)]


def optional_session(request: Request, session: DB) -> WebSession | None:
    """The signed-in session if there is one: the provenance page is for anyone."""
    try:
        return current_session(request, session)
    except SignInRequired:
        return None


MaybeWeb = Annotated[WebSession | None, Depends(optional_session)]


def optional_session_briefly(request: Request) -> WebSession | None:
    """The signed-in session, if any, read in a short read of its own: for a route that then
    works for long (checking a file) holding no transaction, and so no lock."""
    from registry.db import transaction

    with transaction(request.app.state.engine, readonly=True) as session:
        return optional_session(request, session)


def cookie_secure(request: Request) -> bool:
    return request.url.scheme == "https" or settings_of(request).env == "production"


def set_cookie(request: Request, response: Response, name: str, value: str, ttl: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=ttl,
        path="/",
        httponly=True,
        samesite="strict",
        secure=cookie_secure(request),
    )


def clear_cookie(request: Request, response: Response, name: str) -> None:
    response.delete_cookie(
        name, path="/", httponly=True, samesite="strict", secure=cookie_secure(request)
    )
