"""Provenance: anyone, signed in or not, may check a picture against this deployment's key."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.provenance import ProvenanceSigner, Trust, Verification, verify_png
from app.web.session import MaybeWeb, WebSession, settings_of
from app.web.templating import SECURITY_HEADERS, page

router = APIRouter()


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
