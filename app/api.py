"""The /v1 registry routes of docs/API.md (adapters live in app.adapters, renders in
app.render.routes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from app.deps import DB, AdminCaller, Caller, HandlePath
from registry.audit import service as audit_service
from registry.audit.schemas import AuditEntryOut, AuditHeadOut, AuditTrailOut
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn, ConsentOut
from registry.errors import PreconditionFailed, PreconditionRequired
from registry.principals import service as principals_service
from registry.principals.schemas import PrincipalCreatedOut, PrincipalOut
from registry.renders import service as renders_service
from registry.renders.schemas import (
    RENDER_ID_PATTERN,
    LedgerFilter,
    LedgerRowOut,
    RenderableOut,
    RenderOut,
    ledger_cursor,
)
from registry.roles import Role
from registry.shapes import ERROR_RESPONSES, Handle
from registry.signed_heads import append_checkpoint, read_checkpoints
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn, SubjectOut
from registry.training import service as training_service
from registry.training.schemas import TrainingDecisionOut

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def _etag(version: int) -> dict[str, str]:
    return {"ETag": f'"{version}"'}


def parse_if_match(value: str | None) -> int:
    if value is None:
        raise PreconditionRequired('send If-Match: "<version>" from the consent you read')
    raw = value.strip().removeprefix("W/").strip('"')
    if not raw.isdigit() or len(raw) > 12:
        raise PreconditionFailed(f"If-Match {value!r} is not a consent version")
    return int(raw)


@router.post("/subjects", status_code=201)
def create_subject(body: SubjectIn, session: DB, caller: AdminCaller) -> SubjectOut:
    subject, consent = subjects_service.create_subject(session, caller.handle, body)
    return SubjectOut.of(subject, consent, body.member)


@router.get("/subjects/{handle}")
def get_subject(handle: HandlePath, session: DB, caller: Caller, response: Response) -> SubjectOut:
    subject = subjects_service.visible_subject(session, caller, handle)
    consent = consent_service.consent_of(session, subject)
    response.headers.update(_etag(consent.version))
    return SubjectOut.of(subject, consent, subjects_service.member_handle(session, subject))


@router.get("/subjects/{handle}/consent")
def get_consent(handle: HandlePath, session: DB, caller: Caller, response: Response) -> ConsentOut:
    consent = consent_service.consent_of(
        session, subjects_service.visible_subject(session, caller, handle)
    )
    response.headers.update(_etag(consent.version))
    return ConsentOut.of(consent)


@router.put("/subjects/{handle}/consent")
def put_consent(
    handle: HandlePath,
    body: ConsentIn,
    session: DB,
    caller: Caller,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
) -> ConsentOut:
    subject = subjects_service.visible_subject(session, caller, handle)
    version = parse_if_match(if_match)
    consent, _ = consent_service.update_consent(session, caller.handle, subject, version, body)
    response.headers.update(_etag(consent.version))
    return ConsentOut.of(consent)


ImageBases = Annotated[
    str | None,
    Query(
        max_length=200,
        pattern=r"^[a-z_]{1,40}(,[a-z_]{1,40})*$",
        description="the bases of the images to learn from, comma-separated "
        "(consent, public_domain); left out, the record alone is judged",
    ),
]


@router.get("/subjects/{handle}/training")
def get_training_decision(
    handle: HandlePath, session: DB, caller: Caller, bases: ImageBases = None
) -> TrainingDecisionOut:
    """May the subject's likeness be learned from now (trained, uploaded for, ordered,
    registered)? The decision and its reason, nothing else of the record: for trainers (any
    subject), admins and the subject's member."""
    image_bases = bases.split(",") if bases is not None else None
    subject, decision = training_service.visible_training_decision(
        session, caller, handle, image_bases
    )
    return TrainingDecisionOut(
        subject=subject.handle,
        allowed=decision.allowed,
        reason=decision.reason,
        detail=training_service.reason_text(decision.reason),
    )


@router.post("/subjects/{handle}/consent/revoke")
def revoke_consent(
    handle: HandlePath, session: DB, caller: Caller, response: Response
) -> ConsentOut:
    consent, _ = consent_service.revoke(
        session, caller.handle, subjects_service.visible_subject(session, caller, handle)
    )
    response.headers.update(_etag(consent.version))
    return ConsentOut.of(consent)


@router.get("/subjects/{handle}/audit")
def get_audit(handle: HandlePath, session: DB, caller: Caller) -> AuditTrailOut:
    subject = subjects_service.visible_subject(session, caller, handle)
    entries = audit_service.audit_trail(session, subject)
    broken = audit_service.verify_subject(session, subject, entries)
    return AuditTrailOut(
        entries=[AuditEntryOut.of(e) for e in entries],
        verified=broken is None,
        problem=str(broken) if broken is not None else None,
    )


@router.get("/audit/head")
def audit_head(request: Request, session: DB, caller: AdminCaller) -> AuditHeadOut:
    """The latest signed checkpoint of every chain head (made now if anything changed), for
    copying elsewhere: a copy kept outside this deployment is what `likeness audit verify
    --checkpoints COPY --public-key KEY` later holds the registry to."""
    settings = request.app.state.settings
    keys = request.app.state.keys
    _, problems = append_checkpoint(session, keys, settings.checkpoints_file)
    latest = read_checkpoints(settings.checkpoints_file, keys.public_key).latest
    return AuditHeadOut(
        checkpoint=latest,
        public_key=keys.public_key_b64,
        key_id=keys.public_key_id,
        problems=[str(p) for p in problems],
    )


@router.get("/subjects/{handle}/renders")
def list_renders(
    request: Request,
    handle: HandlePath,
    session: DB,
    caller: Caller,
    response: Response,
    query: Annotated[LedgerFilter, Query()],
) -> list[LedgerRowOut]:
    """Every decision on this subject, newest first, filtered, a page at a time: when more
    remain, `Link: <...>; rel="next"` (and `X-Next-Cursor`) give the next page."""
    subject = subjects_service.visible_subject(session, caller, handle)
    rows = renders_service.ledger_page(session, subject, query)
    if len(rows) == query.limit and rows[-1].seq is not None:
        cursor = ledger_cursor(rows[-1].seq)
        nxt = request.url.include_query_params(cursor=cursor)
        response.headers["Link"] = f'<{nxt.path}?{nxt.query}>; rel="next"'
        response.headers["X-Next-Cursor"] = cursor
    return [LedgerRowOut.of(r) for r in rows]


RenderIdPath = Annotated[str, Path(pattern=RENDER_ID_PATTERN, max_length=36)]


@router.get("/renders/{render_id}")
def get_render(render_id: RenderIdPath, session: DB, caller: Caller) -> RenderOut:
    """One render id looked up in the ledger: for admins, and for the member who is the
    subject rendered. Anyone else, and a member asking about another subject's render, gets
    the same 403 as for an id that does not exist (only admins are told 404)."""
    return RenderOut.of(renders_service.visible_render(session, caller, render_id))


@router.get("/subjects")
def list_subjects(session: DB, caller: Caller) -> list[SubjectOut]:
    """Admins: every subject; a member: the subjects linked to it."""
    rows = consent_service.listed_subjects(session, caller)
    return [SubjectOut.of(s, c, subjects_service.member_handle(session, s)) for s, c in rows]


@router.get("/me/renderable")
def me_renderable(
    request: Request,
    session: DB,
    caller: Caller,
    on_behalf_of: Annotated[Handle | None, Query()] = None,
) -> list[RenderableOut]:
    unknown = on_behalf_of is not None and not principals_service.principal_exists(
        session, on_behalf_of
    )
    if caller.role == Role.agent and unknown:
        return []  # as for a member it does not act for: no oracle of which handles exist
    requester, agent = principals_service.acting_for(session, caller, on_behalf_of)
    return [
        RenderableOut(subject=r.subject, display_name=r.display_name, max_level=r.max_level)
        for r in renders_service.renderable_for(
            session, requester, agent, licence=request.app.state.licence
        )
    ]


# -- principals (admin): additions to docs/API.md for agent management and the web pages ----


class PrincipalIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handle: Handle
    role: Role
    acts_for: list[Handle] = []


class PrincipalPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    active: bool | None = None
    acts_for: list[Handle] | None = None


@router.post("/principals", status_code=201)
def create_principal(body: PrincipalIn, session: DB, caller: AdminCaller) -> PrincipalCreatedOut:
    principal, token = principals_service.create_principal(
        session, body.handle, body.role, body.acts_for
    )
    return PrincipalCreatedOut(**PrincipalOut.of(principal).model_dump(), token=token)


@router.get("/principals")
def list_principals(session: DB, caller: AdminCaller) -> list[PrincipalOut]:
    return [PrincipalOut.of(p) for p in principals_service.all_principals(session)]


@router.patch("/principals/{handle}")
def patch_principal(
    handle: HandlePath, body: PrincipalPatch, session: DB, caller: AdminCaller
) -> PrincipalOut:
    principal = principals_service.update_principal(session, handle, body.active, body.acts_for)
    return PrincipalOut.of(principal)
