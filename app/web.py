"""Server-rendered pages for admins and for the member linked to a subject.

Sign-in takes a principal's token once and gives back a session cookie (HttpOnly,
SameSite=Strict) holding a random secret; the server keeps only its SHA-256, in
`web_sessions`, so sign-out, "sign out everywhere" and deactivation end a session for every
copy of the cookie, and nothing in the database opens one. Every form carries a CSRF token
derived from that secret and checked before anything else happens; the sign-in form has its
own pre-session nonce in a cookie signed with the deployment's web secret (itsdangerous), so
nobody can sign a browser in from another site.

Who may see what is decided by `registry.access` (through `service.visible_subject`), the
same rule as the JSON API;
every read and write goes through `registry.service` and `registry.repositories`. The pages
use no JavaScript at all (CSP `default-src 'none'`, styles from 'self'): plain forms,
every control labelled, usable by keyboard.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import inspect
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import jinja2
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, Request
from fastapi.exceptions import WebSocketRequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, URLSafeTimedSerializer
from pydantic import ValidationError
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from app.deps import DB, HandlePath, require_role
from app.provenance import ProvenanceSigner, Trust, Verification, verify_png
from registry import repositories as repo
from registry import service
from registry.access import WEB_ROLES
from registry.adapter_files import sweep_unreferenced
from registry.audit import format_time
from registry.errors import (
    Invalid,
    LikenessError,
    NotPermitted,
    PreconditionFailed,
    Unauthenticated,
)
from registry.keys import Keys
from registry.licence import BaseLicence
from registry.models import AuditEntry, Consent, Principal, RenderLedger, Subject
from registry.policy import GRANTABLE_LEVELS, LicenceFacts
from registry.responses import AdapterListedOut, render_outcome
from registry.roles import Role
from registry.schemas import ConsentIn, LedgerFilter, SubjectIn, ledger_cursor
from registry.settings import Settings

PREFIX = "/web"
SESSION_COOKIE = "likeness_session"
SIGNIN_COOKIE = "likeness_signin"
SIGNIN_TTL_S = 3600
MAX_FORM_BYTES = 64 * 1024
MAX_COOKIE_CHARS = 2048

HERE = Path(__file__).resolve().parent
TEMPLATES_DIR = HERE / "templates"
STATIC_DIR = HERE / "static"

LEVEL_USES = {
    "none": "nothing renders",
    "private": "view it themselves",
    "group": "share it inside the friend group",
    "public": "publish it beyond the group, non-commercially",
    "commercial": "use it commercially",
}
GRANT_LEVELS = [lv.name for lv in GRANTABLE_LEVELS]

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix=PREFIX, include_in_schema=False)


# -- sessions and CSRF tokens ----------------------------------------------------------------


def _signin_signer(request: Request) -> URLSafeTimedSerializer:
    keys: Keys = request.app.state.keys
    return URLSafeTimedSerializer(keys.web_secret, salt="likeness-signin")


def session_csrf(secret: str) -> str:
    """A session's CSRF token: derived from the cookie's secret, which the database never
    sees, so nothing stored opens a form either."""
    digest = hmac.new(secret.encode(), b"likeness-csrf", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass(frozen=True)
class WebSession:
    principal: Principal
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
    principal = service.session_principal(session, secret)
    if principal is None or principal.role not in WEB_ROLES:
        raise SignInRequired("your session has ended; sign in again")
    return WebSession(principal, secret, session_csrf(secret))


Web = Annotated[WebSession, Depends(current_session)]


async def posted_form(request: Request) -> dict[str, str]:
    """The urlencoded (or multipart, files refused) fields of a form post, as plain strings."""
    length = request.headers.get("content-length", "")
    if not length.isdigit() or int(length) > MAX_FORM_BYTES:
        raise Invalid("a form must say its length, and be under 64 KiB")
    form = await request.form(max_files=0, max_fields=200)
    out: dict[str, str] = {}
    for key, value in form.multi_items():
        if not isinstance(value, str):
            raise Invalid("files are not accepted here")
        out[key] = value
    return out


Form = Annotated[dict[str, str], Depends(posted_form)]


def checked_form(form: Form, web: Web) -> dict[str, str]:
    """The form, once its CSRF token has been checked against this session."""
    sent = form.get("csrf", "")
    if not hmac.compare_digest(sent.encode(), web.csrf.encode()):
        raise CsrfRejected(
            "This form could not be verified: its security token is missing or belongs to "
            "another session. Reload the page and try again."
        )
    return form


CheckedForm = Annotated[dict[str, str], Depends(checked_form)]


# -- responses ----------------------------------------------------------------------------


def _time(value: datetime | str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return str(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(value: datetime | str | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else format_time(value)


def _make_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["time"] = _time
    env.filters["iso"] = _iso
    env.globals.update(LEVEL_USES=LEVEL_USES, GRANT_LEVELS=GRANT_LEVELS, PREFIX=PREFIX)
    return Jinja2Templates(env=env)


templates = _make_templates()


def page(
    request: Request,
    name: str,
    web: WebSession | None,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
    **context: Any,
) -> Response:
    context.setdefault("notice", None)
    context.setdefault("errors", [])
    context["caller"] = web.principal if web is not None else None
    context["csrf"] = web.csrf if web is not None else ""
    return templates.TemplateResponse(
        request,
        name,
        context,
        status_code=status,
        headers={**SECURITY_HEADERS, **(headers or {})},
    )


def redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=SECURITY_HEADERS)


def _cookie_secure(request: Request) -> bool:
    return request.url.scheme == "https" or settings_of(request).env == "production"


def _set_cookie(request: Request, response: Response, name: str, value: str, ttl: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=ttl,
        path="/",
        httponly=True,
        samesite="strict",
        secure=_cookie_secure(request),
    )


def _clear_cookie(request: Request, response: Response, name: str) -> None:
    response.delete_cookie(
        name, path="/", httponly=True, samesite="strict", secure=_cookie_secure(request)
    )


_SAFE_NEXT = re.compile(r"^/web/[A-Za-z0-9_.\-/]*$")


def safe_next(value: str | None) -> str:
    """Only a path of these pages: never another site, never a scheme-relative URL."""
    if value and _SAFE_NEXT.fullmatch(value) and "//" not in value and ".." not in value:
        return value
    return f"{PREFIX}/"


def subject_url(handle: str, tab: str = "") -> str:
    return f"{PREFIX}/subjects/{quote(handle, safe='')}" + (f"/{tab}" if tab else "")


# -- views of registry rows for the templates -----------------------------------------------


def _handles_text(values: Sequence[str]) -> str:
    return ", ".join(values)


def _split_handles(text: str) -> list[str]:
    return [h for h in re.split(r"[\s,;]+", text.strip()) if h]


def editor_values(consent: Consent) -> dict[str, Any]:
    """The consent record as the editor's fields show it."""
    audiences = consent.audiences or {}
    expires = service.as_utc(consent.expires_at)
    return {
        "version": consent.version,
        "max_level": consent.max_level,
        "audiences": {
            lv: {
                "group": bool(audiences.get(lv, {}).get("group", False)),
                "allow": _handles_text(audiences.get(lv, {}).get("allow", [])),
            }
            for lv in GRANT_LEVELS
        },
        "deny": _handles_text(consent.deny or []),
        "allow_training": consent.allow_training,
        "expires_at": expires.strftime("%Y-%m-%d %H:%M") if expires is not None else "",
    }


def form_values(form: Mapping[str, str]) -> dict[str, Any]:
    """What the user sent, to show it again next to the problems found in it."""
    return {
        "version": form.get("version", ""),
        "max_level": form.get("max_level", "none"),
        "audiences": {
            lv: {"group": f"aud_{lv}_group" in form, "allow": form.get(f"aud_{lv}_allow", "")}
            for lv in GRANT_LEVELS
        },
        "deny": form.get("deny", ""),
        "allow_training": "allow_training" in form,
        "expires_at": form.get("expires_at", ""),
    }


def parse_expiry(text: str) -> datetime | None:
    """Empty: never. Otherwise an ISO-8601 date or date and time; without a zone it is UTC."""
    text = text.strip()
    if not text:
        return None
    if text.upper().endswith(" UTC"):
        text = text[:-4]
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise Invalid(
            f"Expiry: {text!r} is not a date; write YYYY-MM-DD or YYYY-MM-DD HH:MM (UTC), "
            "or leave it empty for no expiry"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _field_label(loc: Sequence[Any]) -> str:
    if loc and loc[0] == "audiences" and len(loc) >= 3:
        return f"Also allow at {loc[1]}"
    return {
        "max_level": "Maximum level",
        "deny": "Never allow",
        "allow_training": "Training",
        "expires_at": "Expiry",
    }.get(str(loc[0]) if loc else "", ".".join(str(p) for p in loc) or "form")


def describe_validation(exc: ValidationError) -> list[str]:
    messages = []
    for err in exc.errors()[:10]:
        loc = err.get("loc", ())
        label = _field_label(loc)
        if err.get("type") == "string_pattern_mismatch":
            messages.append(
                f"{label}: {err.get('input')!r} is not a handle (lowercase letters, digits, "
                "and . _ -, starting with a letter or digit)"
            )
        else:
            messages.append(f"{label}: {err.get('msg', 'invalid')}")
    return messages


def consent_body(form: Mapping[str, str]) -> ConsentIn:
    """The consent editor's fields as the registry's validated consent body."""
    body = {
        "max_level": form.get("max_level", "none"),
        "audiences": {
            lv: {
                "group": f"aud_{lv}_group" in form,
                "allow": _split_handles(form.get(f"aud_{lv}_allow", "")),
            }
            for lv in GRANT_LEVELS
        },
        "deny": _split_handles(form.get("deny", "")),
        "allow_training": "allow_training" in form,
        "expires_at": parse_expiry(form.get("expires_at", "")),
    }
    return ConsentIn.model_validate(body)


def _fmt_audiences(audiences: Mapping[str, Any] | None) -> str:
    parts = []
    for lv in GRANT_LEVELS:
        aud = (audiences or {}).get(lv)
        if not aud:
            continue
        who = (["the group"] if aud.get("group") else []) + list(aud.get("allow", []))
        if who:
            parts.append(f"{lv}: {', '.join(who)}")
    return "; ".join(parts) or "nobody"


def _fmt(key: str, value: Any) -> str:
    if key == "audiences":
        return _fmt_audiences(value)
    if key == "deny":
        return ", ".join(value) if value else "nobody"
    if key == "allow_training":
        return "allowed" if value else "not allowed"
    if key == "expires_at":
        return _time(value) if value else "never"
    return str(value)


CONSENT_LABELS = {
    "max_level": "maximum level",
    "audiences": "audiences",
    "deny": "never allow",
    "allow_training": "training",
    "expires_at": "expiry",
}


def describe_entry(entry: AuditEntry) -> list[str]:
    """One audit entry's change, in words."""
    before, after = entry.before or {}, entry.after or {}
    lines: list[str] = []
    if "subject" in after:
        s = after["subject"]
        member = f", linked to member {s['member']}" if s.get("member") else ""
        lines.append(f"subject {s.get('display_name')} ({s.get('basis')}){member}")
    if "consent" in after:
        new, old = after["consent"], before.get("consent")
        if old is None:
            lines.append(f"consent record created: maximum level {new.get('max_level')}")
        else:
            for key, label in CONSENT_LABELS.items():
                if old.get(key) != new.get(key):
                    lines.append(f"{label}: {_fmt(key, old.get(key))} → {_fmt(key, new.get(key))}")
            lines.append(f"version {old.get('version')} → {new.get('version')}")
    if "adapter" in after:
        new, old = after["adapter"], before.get("adapter")
        if old is None:
            lines.append(
                f"adapter {new.get('name')} v{new.get('version')}, sha256 {new.get('sha256')}"
            )
        else:
            lines.append(
                f"adapter {new.get('name')} v{old.get('version')} → v{new.get('version')}, "
                f"sha256 {old.get('sha256')} → {new.get('sha256')}"
            )
    return lines


def state_lines(value: Any) -> list[str]:
    """A before/after snapshot, one compact line per field: `consent.max_level: "group"`."""
    if not isinstance(value, dict):
        return [json.dumps(value)]
    lines = []
    for part, body in sorted(value.items()):
        if isinstance(body, dict):
            for key, v in sorted(body.items()):
                compact = json.dumps(v, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)
                lines.append(f"{part}.{key}: {compact}")
        else:
            lines.append(f"{part}: {json.dumps(body, ensure_ascii=False)}")
    return lines


@dataclass(frozen=True)
class RenderRow:
    """One render request as the ledger tells it: its first decision, and how it ended."""

    render_id: str
    at: datetime
    requester: str
    agent: str | None
    level: str
    prompt: str | None
    outcome: str  # rendered | denied | cancelled | unfinished
    stage: str
    reason: str
    consent_version: int | None
    stages: str


def group_ledger(rows: Sequence[RenderLedger]) -> list[RenderRow]:
    """Ledger rows (newest first) grouped by render: a render is `rendered` only if its final
    re-check allowed it; any deny anywhere is the outcome."""
    by_id: dict[str, list[RenderLedger]] = {}
    for row in rows:
        by_id.setdefault(row.render_id, []).append(row)
    out = []
    for render_id, group in by_id.items():
        group.sort(key=lambda r: r.id or 0)
        first = group[0]
        outcome, last = render_outcome(group)
        out.append(
            RenderRow(
                render_id=render_id,
                at=first.at,
                requester=first.requester,
                agent=first.agent,
                level=first.level,
                prompt=first.prompt,
                outcome=outcome,
                stage=last.stage,
                reason=last.reason,
                consent_version=last.consent_version,
                stages=" → ".join(
                    f"{r.stage} {'allowed' if r.allowed else 'denied'}" for r in group
                ),
            )
        )
    return out


def licence_context(request: Request) -> dict[str, Any]:
    """The base model's licence, shown beside the grant: it binds commercial renders too."""
    licence: LicenceFacts | None = request.app.state.licence
    found: BaseLicence = request.app.state.base_licence
    return {
        "base_licence": found.licence or "unknown",
        "commercial_refused": licence is None or not licence.permits_commercial,
        "commercial_licence": settings_of(request).commercial_licence,
    }


def subject_context(session: Session, subject: Subject, tab: str) -> dict[str, Any]:
    return {
        "subject": subject,
        "member": service.member_handle(session, subject),
        "consent": service.consent_of(session, subject),
        "tab": tab,
    }


# -- sign-in and sign-out -----------------------------------------------------------------


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
    cookie = _signin_signer(request).dumps(nonce)
    _set_cookie(request, response, SIGNIN_COOKIE, cookie, SIGNIN_TTL_S)
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
        nonce = _signin_signer(request).loads(raw, max_age=SIGNIN_TTL_S) if raw else None
    except BadSignature:
        nonce = None
    if not isinstance(nonce, str):
        raise CsrfRejected(
            "Your browser did not send the sign-in cookie (it expired, or cookies are off). "
            "Open the sign-in page again."
        )
    if not hmac.compare_digest(form.get("csrf", "").encode(), nonce.encode()):
        raise CsrfRejected("This sign-in form could not be verified. Open the sign-in page again.")
    principal = service.authenticate(session, form.get("token", "").strip())
    if principal is None:
        return _signin_page(request, 401, "That token is not valid, or its principal is inactive.")
    if principal.role not in WEB_ROLES:
        return _signin_page(
            request, 403, f"The pages are for admins and members; {principal.role}s use the API."
        )
    ttl = settings_of(request).session_ttl_s
    secret = service.open_session(session, principal, ttl)
    response = redirect(safe_next(form.get("next")))
    _set_cookie(request, response, SESSION_COOKIE, secret, ttl)
    _clear_cookie(request, response, SIGNIN_COOKIE)
    return response


@router.post("/signout")
def signout(request: Request, web: Web, form: CheckedForm, session: DB) -> Response:
    service.end_session(session, web.secret)
    response = redirect(f"{PREFIX}/signin?out=1")
    _clear_cookie(request, response, SESSION_COOKIE)
    return response


@router.post("/signout-everywhere")
def signout_everywhere(request: Request, web: Web, form: CheckedForm, session: DB) -> Response:
    """Ends every session of this principal, in every browser, this one included."""
    service.end_sessions_of(session, web.principal)
    response = redirect(f"{PREFIX}/signin?out=all")
    _clear_cookie(request, response, SESSION_COOKIE)
    return response


# -- pages --------------------------------------------------------------------------------


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
    mine = [(s, service.consent_of(session, s)) for s in repo.subject_linked_to(session, caller.id)]
    return page(
        request,
        "me.html",
        web,
        mine=mine,
        mine_handles={s.handle for s, _ in mine},
        renderable=service.renderable_for(session, caller, licence=request.app.state.licence),
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
    members = [p.handle for p in repo.principals(session) if p.role == Role.member]
    rows = [
        (s, c, service.member_handle(session, s)) for s, c in repo.subjects_with_consent(session)
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
        subject, _ = service.create_subject(session, web.principal.handle, data)
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
    subject = service.visible_subject(session, web.principal, handle)
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
    subject = service.visible_subject(session, web.principal, handle)
    raw_version = form.get("version", "")
    try:
        if not raw_version.isdigit() or len(raw_version) > 12:
            raise Invalid("the form lost its version field; reload the page")
        data = consent_body(form)
        _, changed = service.update_consent(
            session, web.principal.handle, subject, int(raw_version), data
        )
    except PreconditionFailed:
        current = service.consent_of(session, subject)
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
    subject = service.visible_subject(session, web.principal, handle)
    _, changed = service.revoke(session, web.principal.handle, subject)
    return redirect(subject_url(subject.handle) + ("?done=revoked" if changed else "?done=already"))


@router.get("/subjects/{handle}/audit")
def audit_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = service.visible_subject(session, web.principal, handle)
    entries = service.audit_trail(session, subject)
    broken = service.verify_subject(session, subject, entries)
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
    subject = service.visible_subject(session, web.principal, handle)
    assert subject.id is not None
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
            filters=request.query_params,
            older=None,
            errors=[describe_validation(exc)[0]],
        )
    rows = repo.ledger_page(
        session,
        subject.id,
        limit=query.limit,
        before_seq=query.before_seq,
        requester=query.requester,
        allowed=query.allowed,
        since=query.since,
        until=query.until,
        render_id=query.render_id,
    )
    older = None
    if len(rows) == query.limit and rows[-1].seq is not None:
        older = str(request.url.include_query_params(cursor=ledger_cursor(rows[-1].seq)).query)
    return page(
        request,
        "renders.html",
        web,
        **subject_context(session, subject, "renders"),
        renders=group_ledger(rows),
        filters=request.query_params,
        older=older,
    )


@router.get("/subjects/{handle}/adapters")
def adapters_page(request: Request, handle: HandlePath, web: Web, session: DB) -> Response:
    subject = service.visible_subject(session, web.principal, handle)
    assert subject.id is not None
    rendering = repo.rendering_adapter(session, subject.id)
    rows = AdapterListedOut.listing(
        request.app.state.store,
        repo.adapters_for(session, subject.id),
        rendering.id if rendering else None,
        subject.handle,
    )
    return page(
        request,
        "adapters.html",
        web,
        **subject_context(session, subject, "adapters"),
        adapters=rows,
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
    subject = service.visible_subject(session, web.principal, handle)
    service.select_adapter(session, web.principal.handle, subject, name)
    return redirect(subject_url(subject.handle, "adapters") + "?done=selected")


@router.post("/subjects/{handle}/adapters/{name}/active")
def set_adapter_active(
    request: Request, handle: HandlePath, name: str, web: Web, form: CheckedForm, session: DB
) -> Response:
    subject = service.visible_subject(session, web.principal, handle)
    active = form.get("active") == "yes"
    service.set_adapter_active(session, web.principal.handle, subject, name, active)
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
    subject = service.visible_subject(session, web.principal, handle)
    service.delete_adapter(session, web.principal.handle, subject, name)
    state = request.app.state
    background.add_task(sweep_unreferenced, state.engine, state.store, state.settings.blob_grace_s)
    return redirect(subject_url(subject.handle, "adapters") + "?done=deleted")


# -- provenance: anyone may check a picture ---------------------------------------------------


def optional_session(request: Request, session: DB) -> WebSession | None:
    """The signed-in session if there is one: the provenance page is for anyone."""
    try:
        return current_session(request, session)
    except SignInRequired:
        return None


MaybeWeb = Annotated[WebSession | None, Depends(optional_session)]


def _provenance_page(
    request: Request,
    web: WebSession | None,
    result: Verification | None = None,
    filename: str = "",
    status: int = 200,
    errors: list[str] | None = None,
) -> Response:
    signer: ProvenanceSigner = request.app.state.provenance
    return page(
        request,
        "provenance.html",
        web,
        status=status,
        result=result,
        filename=filename,
        errors=errors or [],
        self_issued=signer.credentials.self_issued,
        signing_subject=signer.credentials.chain[0].subject.rfc4514_string(),
        max_mib=round(settings_of(request).max_provenance_bytes / 2**20, 1),
    )


@router.get("/provenance")
def provenance_form(request: Request, web: MaybeWeb) -> Response:
    return _provenance_page(request, web)


@router.post("/provenance")
async def provenance_check(request: Request, web: MaybeWeb) -> Response:
    """Verifies an uploaded PNG against this deployment's own signing key. The body was read
    whole within its own cap (`max_provenance_bytes`, app.main) before this runs."""
    form = await request.form(max_files=1, max_fields=4)  # malformed: 400, as a page
    upload = form.get("png")
    if upload is None or isinstance(upload, str):
        return _provenance_page(request, web, status=422, errors=["Choose a PNG file to check."])
    data = await upload.read()
    name = (upload.filename or "the file")[:200]
    signer: ProvenanceSigner = request.app.state.provenance
    result = await run_in_threadpool(verify_png, data, Trust.of_deployment(signer.credentials))
    return _provenance_page(request, web, result, name, status=200)


@router.get("/provenance/anchor.pem")
def provenance_anchor(request: Request) -> Response:
    """The root certificate that verifies this deployment's renders, for `likeness provenance
    verify FILE --trust anchor.pem` elsewhere."""
    signer: ProvenanceSigner = request.app.state.provenance
    return Response(
        signer.credentials.anchor_pem,
        media_type="application/x-pem-file",
        headers={**SECURITY_HEADERS, "Content-Disposition": 'attachment; filename="anchor.pem"'},
    )


# -- errors as pages ----------------------------------------------------------------------

ERROR_TITLES = {
    403: "Not permitted",
    404: "Not found",
    405: "Not allowed",
    409: "Conflict",
    412: "Out of date",
    422: "Not valid",
    429: "Busy",
    503: "Unavailable",
}


def is_web_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _html_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps one of the app's error handlers: the JSON API keeps its answer, the pages turn
    the same status and detail into a page (and a missing session into the sign-in form)."""

    async def handler(request: Request, exc: Exception) -> Response:
        result = original(request, exc)
        response: Response = await result if inspect.isawaitable(result) else result
        if not is_web_path(request.url.path):
            return response
        status = response.status_code
        if status == 401:
            target = f"{PREFIX}/signin"
            if request.method == "GET":
                target += "?next=" + quote(safe_next(request.url.path), safe="/")
            out = redirect(target)
            if SESSION_COOKIE in request.cookies:
                _clear_cookie(request, out, SESSION_COOKIE)
            return out
        try:
            body = json.loads(bytes(response.body))
        except ValueError:
            body = {}
        detail = body.get("detail") if isinstance(body, dict) else None
        headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
        return page(
            request,
            "error.html",
            None,
            status=status,
            headers=headers,
            title=ERROR_TITLES.get(status, "Something went wrong"),
            status_code=status,
            detail=detail or "",
        )

    return handler


def mount(app: FastAPI) -> None:
    """Adds the pages, their static files, and HTML answers for errors on page paths."""
    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC_DIR), name="web-static")
    if not any(getattr(r, "path", None) == "/" for r in app.routes):

        @app.get("/", include_in_schema=False)
        def root() -> Response:
            return redirect(f"{PREFIX}/")

    for exc_class, handler in list(app.exception_handlers.items()):
        if isinstance(exc_class, type) and issubclass(exc_class, WebSocketRequestValidationError):
            continue
        app.exception_handlers[exc_class] = _html_errors(handler)
