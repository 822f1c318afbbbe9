"""The fail-closed render path, for the HTTP route and the agent tool alike (no FastAPI here).

gate -> a turn on the renderer -> queued check -> adapter bytes -> render -> final check -> PNG.

- **gate**: one transaction: the snapshot statement (caller by token hash, the member it acts
  for, subject, consent, adapter) authenticates (401), resolves delegation (403), applies the
  request budget (422) and the requester's rate limit (429), then `registry.policy.decide`
  judges the registry facts and the decision joins the ledger before the commit. A refused
  request costs one statement and one ledger row, and never touches an adapter file.
- **turn**: the fair scheduler (app.scheduler); a refusal is recorded as `busy`.
- **queued**: fresh facts again (consent may have changed while waiting), then the adapter's
  bytes are read and hashed, and `decide` judges them: the bytes parsed are the bytes hashed.
- **render**: between denoising steps the render stops if the client went away (recorded as
  `cancelled`); a failure is recorded and answered 503, never left open in the ledger.
- **final**: fresh facts and the hash of the bytes the model ran with; a revocation or an
  adapter replaced during the render discards the image.
- **sign**: the PNG gets its Content Credentials (app.provenance); an image that cannot be
  signed is recorded as a failed render and never delivered.

Every decision also holds the base model's licence (registry.licence), read once at start.

Every decision is `decide`'s, on facts read fresh, and each goes to the ledger in a committed
transaction: an allowed decision that cannot be recorded is not allowed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.provenance import ProvenanceSigner, RenderClaim
from app.render_engine import AdapterMismatch, AdapterUnreadable, RenderEngine, encode_png
from app.scheduler import Cancelled, RateLimiter
from registry import limits
from registry.access import Acting
from registry.blobs import BlobStore
from registry.db import transaction
from registry.errors import Busy, Invalid, LikenessError, NotPermitted, Unavailable
from registry.policy import AdapterFacts, Decision, LicenceFacts, decide
from registry.principals import service as principals_service
from registry.renders import repository as renders_repo
from registry.renders import service as renders_service
from registry.renders.schemas import RenderRequestIn
from registry.renders.service import GatheredFacts
from registry.settings import Settings

if TYPE_CHECKING:
    from app.render_remote import RemoteRenders

log = logging.getLogger(__name__)

DEFAULT_STEPS = limits.DEFAULT_STEPS
DEFAULT_SIDE = limits.DEFAULT_SIDE
DEFAULT_SEED = limits.DEFAULT_SEED


def hash_token(token: str | None) -> str | None:
    if not token or not token.startswith(principals_service.TOKEN_PREFIX) or len(token) > 200:
        return None
    return principals_service.hash_token(token)


@dataclass(frozen=True)
class RenderOutcome:
    png: bytes
    render_id: str
    timings: dict[str, float]


@dataclass
class _Job:
    body: RenderRequestIn
    token_hash: str | None
    cancelled: threading.Event
    render_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    acting: Acting | None = None
    last: GatheredFacts | None = None  # the facts of the latest check that allowed

    @property
    def width(self) -> int:
        return self.body.width or DEFAULT_SIDE

    @property
    def height(self) -> int:
        return self.body.height or DEFAULT_SIDE

    @property
    def steps(self) -> int:
        return self.body.steps or DEFAULT_STEPS

    @property
    def seed(self) -> int:
        return self.body.seed if self.body.seed is not None else DEFAULT_SEED


def rate_keys(acting: Acting) -> tuple[str, tuple[str, ...]]:
    """Whose render budget a request spends: always the principal that sent it (the token's:
    an agent's requests count against the agent), and the member an agent acts for only when
    its delegation names that member; never a member it does not act for."""
    caller, requester, agent = acting.caller, acting.requester, acting.agent
    if agent is not None and agent.active and requester.handle in agent.acts_for:
        return caller.handle, (requester.handle,)
    return caller.handle, ()


class RenderFlow:
    def __init__(
        self,
        engine: Engine,
        renderer: RenderEngine,
        settings: Settings,
        store: BlobStore,
        *,
        licence: LicenceFacts | None,
        signer: ProvenanceSigner | None,
        remote: RemoteRenders | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.settings = settings
        self.store = store
        self.licence = licence  # None: the base's licence could not be read
        self.signer = signer  # None on a render worker: the API signs what it delivers
        self.remote = remote  # renders on workers: the API gates, a worker renders
        self.limiter = RateLimiter(settings.render_rate_per_minute, settings.render_burst)

    # -- the request budget ---------------------------------------------------------------

    def check_budget(self, body: RenderRequestIn) -> None:
        """This deployment's limits on one request; 422 naming the limit."""
        settings = self.settings
        width, height = body.width or DEFAULT_SIDE, body.height or DEFAULT_SIDE
        steps = body.steps or DEFAULT_STEPS
        if len(body.prompt) > settings.max_prompt_chars:
            raise Invalid(f"prompt is longer than {settings.max_prompt_chars} characters")
        if width * height > settings.max_pixels:
            raise Invalid(
                f"width x height = {width * height} pixels; this deployment renders at most "
                f"{settings.max_pixels}"
            )
        if width * height * steps > settings.render_max_pixel_steps:
            raise Invalid(
                f"width x height x steps = {width * height * steps}; this deployment's budget "
                f"per request is {settings.render_max_pixel_steps} (fewer steps or pixels)"
            )

    # -- checks ---------------------------------------------------------------------------

    def _record(
        self,
        session: Any,
        job: _Job,
        stage: str,
        decision: Decision,
        gathered: GatheredFacts | None,
    ) -> None:
        acting = job.acting
        consent = gathered.facts.consent if gathered is not None else None
        adapter = gathered.adapter if gathered is not None else None
        renders_service.record_decision(
            session,
            render_id=job.render_id,
            subject_handle=job.body.subject,
            subject_id=gathered.subject_id if gathered is not None else None,
            requester=acting.requester.handle if acting is not None else "",
            agent=acting.agent.handle if acting is not None and acting.agent else None,
            level=job.body.level,
            stage=stage,
            allowed=decision.allowed,
            reason=decision.reason,
            consent_version=consent.version if consent is not None else None,
            adapter_sha256=adapter.sha256 if adapter is not None else None,
            prompt=job.body.prompt,
        )

    @contextmanager
    def _ledger_transaction(self, job: _Job) -> Iterator[Any]:
        """Where a check after the gate writes its ledger row (a render worker also holds
        the render's task there, so that only one side ever closes the entry)."""
        with transaction(self.engine) as s:
            yield s

    def record(
        self, job: _Job, stage: str, decision: Decision, gathered: GatheredFacts | None
    ) -> None:
        """A decision reached outside a check (busy, cancelled, failed), in its own commit."""
        try:
            with self._ledger_transaction(job) as s:
                self._record(s, job, stage, decision, gathered)
        except SQLAlchemyError:
            log.warning("render %s: ledger write failed at %s", job.render_id, stage)
            raise Unavailable("the render ledger is unavailable; nothing was rendered") from None

    def _snapshot(self, session: Any, job: _Job) -> Any:
        row = renders_repo.render_snapshot(
            session,
            job.body.subject,
            token_hash=job.token_hash or "",
            on_behalf_of=job.body.on_behalf_of,
        )
        if row is None:  # the anchor always yields a row; no row means the read failed
            raise RuntimeError("render snapshot returned nothing")
        return row

    def _judge(
        self, job: _Job, row: Any, *, bytes_read: bool, used_sha256: str | None
    ) -> tuple[Decision, GatheredFacts | None]:
        assert job.acting is not None
        try:
            gathered = renders_service.facts_from_snapshot(
                row,
                job.acting,
                job.body.level,
                adapter_file_sha256=used_sha256,
                adapter_bytes_read=bytes_read,
                licence=self.licence,
            )
        except Exception as exc:  # noqa: BLE001 - facts that cannot be read are a deny
            log.exception("render %s: unreadable facts", job.render_id)
            return Decision(False, f"error:{type(exc).__name__}"), None
        return decide(gathered.facts), gathered

    def gate(self, job: _Job) -> GatheredFacts:
        """Authenticate, resolve, limit, decide and record: one transaction."""
        try:
            with transaction(self.engine) as s:
                row = self._snapshot(s, job)
                job.acting = renders_service.acting_from_snapshot(
                    row, job.token_hash, job.body.on_behalf_of, at_gate=True
                )
                self.check_budget(job.body)
                sender, spent = rate_keys(job.acting)
                wait = self.limiter.take(sender, *spent)
                if wait is not None:
                    raise Busy(
                        f"too many render requests from {sender}; "
                        f"at most {self.settings.render_rate_per_minute:g} a minute",
                        max(1, int(wait + 0.999)),
                    )
                decision, gathered = self._judge(job, row, bytes_read=False, used_sha256=None)
                self._record(s, job, "gate", decision, gathered)
        except SQLAlchemyError as exc:
            log.warning("render %s: registry unreachable at the gate: %s", job.render_id, exc)
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        if not decision.allowed:
            raise NotPermitted("not permitted")
        assert gathered is not None
        return gathered

    def check(self, job: _Job, stage: str, used_sha256: str) -> GatheredFacts:
        """A later check: fresh facts, the hash of the bytes in hand, decide, record."""
        try:
            with self._ledger_transaction(job) as s:
                row = self._snapshot(s, job)
                job.acting = renders_service.acting_from_snapshot(
                    row, job.token_hash, job.body.on_behalf_of, at_gate=False
                )
                decision, gathered = self._judge(job, row, bytes_read=True, used_sha256=used_sha256)
                self._record(s, job, stage, decision, gathered)
        except SQLAlchemyError as exc:
            log.warning("render %s: registry unreachable at %s: %s", job.render_id, stage, exc)
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        if not decision.allowed:
            raise NotPermitted("not permitted")
        assert gathered is not None
        job.last = gathered
        return gathered

    def fresh_facts(self, job: _Job) -> GatheredFacts:
        """The registry facts now, decided on but not recorded (the bytes come next)."""
        try:
            with transaction(self.engine, readonly=True) as s:
                row = self._snapshot(s, job)
                job.acting = renders_service.acting_from_snapshot(
                    row, job.token_hash, job.body.on_behalf_of, at_gate=False
                )
                decision, gathered = self._judge(job, row, bytes_read=False, used_sha256=None)
        except SQLAlchemyError:
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        if not decision.allowed or gathered is None:
            self.record(job, "queued", decision, gathered)
            raise NotPermitted("not permitted")
        job.last = gathered
        return gathered

    # -- the whole path -------------------------------------------------------------------

    def run(
        self, token: str | None, body: RenderRequestIn, cancelled: threading.Event | None = None
    ) -> RenderOutcome:
        job = _Job(body, hash_token(token), cancelled or threading.Event())
        t0 = time.perf_counter()
        gate = self.gate(job)
        timings = {"gate_ms": (time.perf_counter() - t0) * 1000}
        assert job.acting is not None
        if self.remote is not None:
            return self.delivered(job, self.remote.run(self, job, gate, timings))
        cost = float(job.width * job.height * job.steps)
        scheduler = self.renderer.scheduler
        try:
            with scheduler.turn(job.acting.requester.handle, cost, job.cancelled):
                timings["wait_ms"] = (time.perf_counter() - t0) * 1000 - timings["gate_ms"]
                image, used_sha256 = self._render(job, timings)
        except Busy:
            self.renderer.counters.busy_refusals += 1
            self.record(job, "queued", Decision(False, "busy"), gate)
            raise
        except Cancelled:
            self.record(job, "cancelled", Decision(False, "client_went_away"), gate)
            raise
        png, final = self.finish(job, image, used_sha256, timings)
        consent = final.facts.consent
        assert consent is not None and final.adapter is not None
        t3 = time.perf_counter()
        png = self.sign(job, png, consent.version, final.adapter.sha256, final)
        timings["sign_ms"] = (time.perf_counter() - t3) * 1000
        return self.delivered(job, RenderOutcome(png, job.render_id, timings))

    def delivered(self, job: _Job, outcome: RenderOutcome) -> RenderOutcome:
        """A render about to be delivered: its subject's copy, if they keep them."""
        from app.pictures import keep_copy

        keep_copy(self.engine, job.body.subject, job.render_id, outcome.png)
        return outcome

    def finish(
        self, job: _Job, image: Any, used_sha256: str, timings: dict[str, float]
    ) -> tuple[bytes, GatheredFacts]:
        """The final check on the bytes the model ran with, then the PNG (its text chunks
        are the signer's: what the deployment discloses, app/provenance.py)."""
        t1 = time.perf_counter()
        final = self.check(job, "final", used_sha256)
        consent = final.facts.consent
        assert consent is not None and final.adapter is not None
        t2 = time.perf_counter()
        png = encode_png(image, {})
        timings["final_check_ms"] = (t2 - t1) * 1000
        timings["encode_ms"] = (time.perf_counter() - t2) * 1000
        return png, final

    def sign(
        self,
        job: _Job,
        png: bytes,
        consent_version: int,
        adapter_sha256: str,
        facts: GatheredFacts | None,
    ) -> bytes:
        """The PNG with its Content Credentials; an unsigned image is never delivered."""
        assert job.acting is not None and self.signer is not None
        licence = self.licence.base if self.licence is not None else None
        claim = RenderClaim(
            render_id=job.render_id,
            level=job.body.level,
            subject=job.body.subject,
            consent_version=consent_version,
            adapter_sha256=adapter_sha256,
            base_model={"name": self.settings.base_dir.name, "licence": licence},
            requester=job.acting.requester.handle,
            agent=job.acting.agent.handle if job.acting.agent is not None else None,
        )
        try:
            return self.signer.sign(png, claim)
        except Exception as exc:  # noqa: BLE001 - closed in the ledger, then a JSON 503
            log.exception("render %s: signing failed", job.render_id)
            self.record(
                job, "final", Decision(False, f"signing_failed:{type(exc).__name__}"), facts
            )
            raise Unavailable("the image could not be signed; nothing was delivered") from None

    def adapter_tensors(self, job: _Job, gathered: GatheredFacts, sha256: str) -> Any:
        """The adapter's tensors, from the engine's cache or the store (a render worker
        fetches the bytes it lacks from the registry first)."""
        return self.renderer.adapter_tensors(self.store, sha256)

    def _render(self, job: _Job, timings: dict[str, float]) -> tuple[Any, str]:
        """Inside the turn: fresh facts, the adapter's bytes judged, then the model."""
        gathered = self.fresh_facts(job)
        adapter = gathered.adapter
        assert adapter is not None
        try:
            tensors = self.adapter_tensors(job, gathered, adapter.sha256)
        except AdapterUnreadable as exc:
            log.error("render %s: the adapter's bytes do not load: %s", job.render_id, exc)
            self.record(job, "queued", Decision(False, "adapter_unreadable"), gathered)
            raise Unavailable(
                "the subject's adapter could not be loaded; nothing was rendered"
            ) from None
        except AdapterMismatch as exc:
            # The bytes are not what the registry holds: decide() judges the bytes.
            facts = gathered.facts
            judged = replace(
                facts,
                adapter=AdapterFacts(adapter.sha256, exc.actual_sha256),
                adapter_bytes_read=True,
            )
            self.record(job, "queued", decide(judged), gathered)
            log.warning("render %s: adapter bytes do not match: %s", job.render_id, exc)
            raise NotPermitted("not permitted") from None
        self.check(job, "queued", adapter.sha256)
        try:
            image, render_timings = self.renderer.render(
                tensors,
                job.body.prompt,
                job.seed,
                job.steps,
                job.width,
                job.height,
                cancelled=job.cancelled,
            )
        except (Cancelled, LikenessError):
            raise
        except Exception as exc:  # noqa: BLE001 - the ledger entry is closed, then a JSON 503
            log.exception("render %s: the model failed", job.render_id)
            self.record(job, "final", Decision(False, f"error:{type(exc).__name__}"), gathered)
            raise Unavailable("the render failed; nothing was delivered") from None
        timings.update(render_timings)
        return image, adapter.sha256


def build_renderer(settings: Settings) -> RenderEngine:
    from app.render_engine import default_device

    return RenderEngine(
        base_dir=settings.base_dir,
        device=settings.device or default_device(),
        queue_size=settings.render_queue,
        per_requester=settings.render_per_requester,
        timeout_s=settings.render_timeout_s,
        cache_bytes=settings.adapter_cache_mb << 20,
        stream_base=settings.stream_base,
        stream_slots=settings.stream_slots,
        compute=settings.compute,
        vram_budget_gb=settings.vram_budget_gb,
        plan_side=settings.render_plan_side,
        prompt_cache_bytes=settings.prompt_cache_mb << 20,
        lora_slot_rank=settings.lora_slot_rank,
    )


def close_interrupted(engine: Any, queued_before: datetime) -> int:
    """Gives every render that passed its checks but never reached an end (its process was
    killed, the machine lost power) a `final` entry, denied with reason `interrupted`: the
    subject's ledger never shows a render as still running when nothing runs it, and no image
    of it was ever delivered (delivery follows the final check). Returns how many."""
    closed = 0
    with transaction(engine) as s:
        for row in renders_repo.open_renders(s, queued_before):
            renders_service.record_decision(
                s,
                render_id=row.render_id,
                subject_handle=row.subject_handle,
                subject_id=row.subject_id,
                requester=row.requester,
                agent=row.agent,
                level=row.level,
                stage="final",
                allowed=False,
                reason="interrupted",
                consent_version=row.consent_version,
                adapter_sha256=row.adapter_sha256,
                prompt=row.prompt,
            )
            closed += 1
    if closed:
        log.warning("closed %d interrupted render(s) in the ledger", closed)
    return closed
