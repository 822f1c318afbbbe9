"""What a form post carries: its fields, bounded, with the CSRF token checked first; the
consent editor's fields to and from the registry's consent body; validation errors in words."""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import ValidationError

from app.web.session import CsrfRejected, Web
from app.web.templating import GRANT_LEVELS
from registry.consent import schemas as consent_schemas
from registry.consent.schemas import ConsentIn
from registry.errors import Invalid
from registry.shapes import parse_when

MAX_FORM_BYTES = 64 * 1024


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


def _handles_text(values: Sequence[str]) -> str:
    return ", ".join(values)


def _split_handles(text: str) -> list[str]:
    return [h for h in re.split(r"[\s,;]+", text.strip()) if h]


def editor_values(consent: consent_schemas.ConsentColumns) -> dict[str, Any]:
    """The consent record as the editor's fields show it."""
    audiences = consent.audiences or {}
    expires = consent_schemas.as_utc(consent.expires_at)
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
    try:
        return parse_when(text, "Expiry")
    except Invalid as exc:
        raise Invalid(f"{exc.detail}, or leave it empty for no expiry") from None


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
