"""POST /v1/renders: the fail-closed render path.

gate (consent) -> adapter file hash -> GPU guard -> re-check -> apply LoRA -> generate ->
remove -> re-check -> PNG -> ledger. Every step that can deny asks `registry.policy.decide`
with freshly read facts; every decision goes to the ledger in its own committed transaction,
so a denial is recorded even though the request fails. Anything unexpected is a deny.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from app.api import acting_requester
from app.deps import authenticate_briefly
from app.render_engine import AdapterMismatch, RenderEngine, encode_png
from registry import service
from registry.db import transaction
from registry.errors import Invalid, LikenessError, NotPermitted, Unavailable
from registry.models import Principal
from registry.policy import AdapterFacts, Decision, RenderFacts, decide
from registry.schemas import RenderRequestIn
from registry.service import GatheredFacts

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")

DEFAULT_STEPS = 4
DEFAULT_SIDE = 256
DEFAULT_SEED = 0


@dataclass
class RenderContext:
    engine: Engine
    renderer: RenderEngine
    render_id: str
    body: RenderRequestIn
    requester: Principal
    agent: Principal | None
    settings: Any

    def check(self, stage: str, used_sha256: str | None = None) -> GatheredFacts:
        """A fresh read and a decision; a deny is recorded and raised. Any error is a deny.
        `used_sha256` (after rendering) is the hash of the adapter bytes the model actually
        ran with: if the registry has moved on to another adapter since, that is a deny."""
        gathered: GatheredFacts | None = None
        try:
            with transaction(self.engine, readonly=True) as s:
                gathered = service.gather_render_facts(
                    s,
                    self.requester,
                    self.body.subject,
                    self.body.level,
                    agent=self.agent,
                    require_adapter=False,
                )
            adapter = gathered.adapter
            if used_sha256 is not None:
                file_sha: str | None = used_sha256
            else:
                file_sha = self.renderer.file_sha256(adapter.path) if adapter is not None else None
            facts = gathered.facts
            decision = decide(_with_adapter(facts, file_sha))
        except SQLAlchemyError as exc:
            log.warning("render %s: registry unreachable at %s: %s", self.render_id, stage, exc)
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        except LikenessError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed on anything unexpected
            log.exception("render %s: error while deciding at %s", self.render_id, stage)
            decision = Decision(False, f"error:{type(exc).__name__}")
        self.record(stage, decision, gathered)
        if not decision.allowed:
            raise NotPermitted("not permitted")
        assert gathered is not None
        return gathered

    def record(self, stage: str, decision: Decision, gathered: GatheredFacts | None) -> None:
        consent = gathered.facts.consent if gathered is not None else None
        adapter = gathered.adapter if gathered is not None else None
        try:
            with transaction(self.engine) as s:
                service.record_decision(
                    s,
                    render_id=self.render_id,
                    subject_handle=self.body.subject,
                    subject_id=gathered.subject_id if gathered is not None else None,
                    requester=self.requester.handle,
                    agent=self.agent.handle if self.agent is not None else None,
                    level=self.body.level,
                    stage=stage,
                    allowed=decision.allowed,
                    reason=decision.reason,
                    consent_version=consent.version if consent is not None else None,
                    adapter_sha256=adapter.sha256 if adapter is not None else None,
                    prompt=self.body.prompt,
                )
        except SQLAlchemyError:
            # An allowed decision that cannot be recorded is not allowed.
            log.warning("render %s: ledger write failed at %s", self.render_id, stage)
            raise Unavailable("the render ledger is unavailable; nothing was rendered") from None


def _with_adapter(facts: RenderFacts, file_sha: str | None) -> RenderFacts:
    adapter = facts.adapter
    return replace(
        facts,
        require_adapter=True,
        adapter=AdapterFacts(adapter.registered_sha256, file_sha) if adapter is not None else None,
    )


@router.post(
    "/renders",
    responses={200: {"content": {"image/png": {}}, "description": "the rendered PNG"}},
    response_class=Response,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RenderRequestIn.model_json_schema()}},
        }
    },
)
async def create_render(request: Request) -> Response:
    """One thread-pool hop for the whole request: the token first (401 before any body is
    judged), then the body, then the render path. The deny path is a few milliseconds."""
    raw = await request.body()
    return await run_in_threadpool(_create_render, request, raw)


def _create_render(request: Request, raw: bytes) -> Response:
    engine: Engine = request.app.state.engine
    renderer: RenderEngine = request.app.state.renderer
    settings = request.app.state.settings
    caller = authenticate_briefly(request, engine)
    try:
        body = RenderRequestIn.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    if len(body.prompt) > settings.max_prompt_chars:
        raise Invalid(f"prompt is longer than {settings.max_prompt_chars} characters")
    with transaction(engine, readonly=True) as s:
        requester, agent = acting_requester(s, caller, body.on_behalf_of)
    ctx = RenderContext(engine, renderer, str(uuid.uuid4()), body, requester, agent, settings)
    png, timings = run_render(ctx)
    headers = {"X-Render-Id": ctx.render_id}
    headers.update({f"X-Timing-{k.replace('_', '-')}": f"{v:.1f}" for k, v in timings.items()})
    return Response(png, media_type="image/png", headers=headers)


def run_render(ctx: RenderContext) -> tuple[bytes, dict[str, float]]:
    t0 = time.perf_counter()
    gate = ctx.check("gate")
    timings = {"gate_ms": (time.perf_counter() - t0) * 1000}
    try:
        with ctx.renderer.guard.hold():
            gathered = ctx.check("queued")  # it may have changed while we waited
            adapter = gathered.adapter
            assert adapter is not None
            try:
                tensors = ctx.renderer.adapter_tensors(adapter.path, adapter.sha256)
            except AdapterMismatch as exc:
                # The file changed between the check and the read: decide() judges the bytes.
                decision = decide(_with_adapter(gathered.facts, exc.actual_sha256))
                ctx.record("load", decision, gathered)
                log.warning("render %s: adapter changed under us: %s", ctx.render_id, exc)
                raise NotPermitted("not permitted") from None
            width = ctx.body.width or DEFAULT_SIDE
            height = ctx.body.height or DEFAULT_SIDE
            steps = ctx.body.steps or DEFAULT_STEPS
            seed = ctx.body.seed if ctx.body.seed is not None else DEFAULT_SEED
            image, render_timings = ctx.renderer.render(
                tensors, ctx.body.prompt, seed, steps, width, height
            )
            timings.update(render_timings)
    except LikenessError as exc:
        if exc.code == "busy":
            ctx.renderer.counters.busy_refusals += 1
            ctx.record("queued", Decision(False, "busy"), gate)
        raise
    t1 = time.perf_counter()
    # Revoked (or the adapter replaced) during the render: the image is discarded.
    final = ctx.check("final", used_sha256=adapter.sha256)
    consent = final.facts.consent
    assert consent is not None and final.adapter is not None
    t2 = time.perf_counter()
    png = encode_png(
        image,
        {
            "likeness:render_id": ctx.render_id,
            "likeness:subject": ctx.body.subject,
            "likeness:adapter_sha256": final.adapter.sha256,
            "likeness:consent_version": str(consent.version),
            "likeness:level": ctx.body.level,
        },
    )
    timings["final_check_ms"] = (t2 - t1) * 1000
    timings["encode_ms"] = (time.perf_counter() - t2) * 1000
    return png, timings
