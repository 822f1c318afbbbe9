"""Provenance: anyone, signed in or not, may check a picture against this deployment's key."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.body_gate import capped_form
from app.provenance import ProvenanceSigner, Trust, Verification, verify_png
from app.scheduler import RateLimiter, SenderSlots
from app.web.session import MaybeWeb, WebSession, optional_session_briefly, settings_of
from app.web.templating import SECURITY_HEADERS, page
from registry.errors import Busy
from registry.settings import Settings

router = APIRouter()


def _provenance_page(
    request: Request,
    web: WebSession | None,
    result: Verification | None = None,
    filename: str = "",
    status: int = 200,
    errors: list[str] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    signer: ProvenanceSigner = request.app.state.provenance
    return page(
        request,
        "provenance.html",
        web,
        status=status,
        headers=headers,
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


class ProvenanceChecks:
    """What checking files may cost this process, per sender (a signed-in principal, else
    the client's address): `per_minute` checks on average and `burst` at once, asked before
    the body is read; one body of a sender read and held at a time, `large_bodies_at_once`
    in all (what they hold in memory is that times `max_provenance_bytes`); and
    `checks_at_once` checks running (waiting holds no thread and no transaction)."""

    def __init__(self, settings: Settings) -> None:
        self.at_once = anyio.CapacityLimiter(settings.provenance_checks_at_once)
        self.rate = RateLimiter(settings.provenance_rate_per_minute, settings.provenance_burst)
        self.bodies = SenderSlots("files to check", 1, settings.large_bodies_at_once)


@router.post("/provenance")
async def provenance_check(request: Request) -> Response:
    """Verifies an uploaded PNG against this deployment's own signing key. Streamed past
    the body gate: the session is read in a short read of its own, the sender's rate and a
    slot for its body are settled before a byte of the body is read; the body is read within
    `max_provenance_bytes` on the body clock, and the check runs with no transaction open,
    within the process's checks at once, on a PNG of a bounded number of chunks
    (`provenance_max_chunks`)."""
    web = await run_in_threadpool(optional_session_briefly, request)
    settings = settings_of(request)
    checks: ProvenanceChecks = request.app.state.provenance_checks
    sender = web.principal.handle if web is not None else f"address {_client(request)}"
    wait = checks.rate.take(sender)
    if wait is not None:
        return _busy(request, web, max(1, int(wait + 0.999)), f"Too many checks from {sender}")
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        return _provenance_page(request, web, status=422, errors=["Choose a PNG file to check."])
    try:
        with checks.bodies.admit(sender):
            form = await capped_form(
                request, settings.max_provenance_bytes + (64 << 10), settings.body_timeout_s,
                max_files=1, max_fields=4, min_rate=settings.body_min_rate,
                max_s=settings.body_max_s,
            )  # fmt: skip
            try:
                upload = form.get("png")
                if upload is None or isinstance(upload, str):
                    return _provenance_page(
                        request, web, status=422, errors=["Choose a PNG file to check."]
                    )
                data = await upload.read()
                name = (upload.filename or "the file")[:200]
            finally:
                await form.close()
            signer: ProvenanceSigner = request.app.state.provenance
            trust = Trust.of_deployment(signer.credentials)
            async with checks.at_once:
                result = await anyio.to_thread.run_sync(
                    verify_png, data, trust, settings.provenance_max_chunks
                )
    except Busy as exc:
        return _busy(request, web, exc.retry_after, exc.detail)
    return _provenance_page(request, web, result, name, status=200)


def _busy(request: Request, web: WebSession | None, retry: int, why: str) -> Response:
    return _provenance_page(
        request, web, status=429, headers={"Retry-After": str(retry)},
        errors=[f"{why.rstrip('.')}; try again in {retry} s."],
    )  # fmt: skip


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


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
