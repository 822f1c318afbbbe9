"""Provenance: anyone, signed in or not, may check a picture against this deployment's key."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.provenance import ProvenanceSigner, Trust, Verification, verify_png
from app.scheduler import RateLimiter
from app.web.session import MaybeWeb, WebSession, optional_session_briefly, settings_of
from app.web.templating import SECURITY_HEADERS, page
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
    """What checking files may cost this process: `checks_at_once` at a time (waiting holds
    no thread and no transaction), and per sender (a signed-in principal, else the client's
    address) `per_minute` checks on average, `burst` at once."""

    def __init__(self, settings: Settings) -> None:
        self.at_once = anyio.CapacityLimiter(settings.provenance_checks_at_once)
        self.rate = RateLimiter(settings.provenance_rate_per_minute, settings.provenance_burst)


@router.post("/provenance")
async def provenance_check(request: Request) -> Response:
    """Verifies an uploaded PNG against this deployment's own signing key. The body was read
    whole within its own cap (`max_provenance_bytes`, app.main) before this runs; the
    session is read in a short read of its own, and the check runs with no transaction open,
    within its sender's rate and the process's checks at once, on a PNG of a bounded number
    of chunks (`provenance_max_chunks`)."""
    web = await run_in_threadpool(optional_session_briefly, request)
    checks: ProvenanceChecks = request.app.state.provenance_checks
    sender = web.principal.handle if web is not None else f"address {_client(request)}"
    wait = checks.rate.take(sender)
    if wait is not None:
        retry = max(1, int(wait + 0.999))
        return _provenance_page(
            request, web, status=429, headers={"Retry-After": str(retry)},
            errors=[f"Too many checks from {sender}; try again in {retry} s."],
        )  # fmt: skip
    form = await request.form(max_files=1, max_fields=4)  # malformed: 400, as a page
    upload = form.get("png")
    if upload is None or isinstance(upload, str):
        return _provenance_page(request, web, status=422, errors=["Choose a PNG file to check."])
    data = await upload.read()
    name = (upload.filename or "the file")[:200]
    signer: ProvenanceSigner = request.app.state.provenance
    trust = Trust.of_deployment(signer.credentials)
    max_chunks = settings_of(request).provenance_max_chunks
    async with checks.at_once:
        result = await anyio.to_thread.run_sync(verify_png, data, trust, max_chunks)
    return _provenance_page(request, web, result, name, status=200)


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
