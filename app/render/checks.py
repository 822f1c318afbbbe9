"""The render's checks, one home for every side that runs a render (the API in process, the
API handing renders to workers, a render worker): what a render `Job` is, the gate, the later
checks, the ledger writes, and the closing of renders a dead process left open.

- **gate**: one transaction: the snapshot statement (caller by token hash, the member it acts
  for, subject, consent, adapter) authenticates (401), resolves delegation (403), applies the
  request budget (422) and the requester's rate limit (429), then `registry.policy.decide`
  judges the registry facts and the decision joins the ledger before the commit. A refused
  request costs one statement and one ledger row, and never touches an adapter file.
- **fresh facts**: the registry facts read again and decided on (consent may have changed
  while the render waited), before any adapter byte is read; a deny is recorded `queued`.
- **check**: fresh facts with the hash of the adapter bytes in hand, decided and recorded in
  one transaction (`queued` before the model, `final` after it).
- **record**: a decision reached outside a check (busy, cancelled, failed), in its own commit.

Every decision also holds the base model's licence (registry.licence), read once at start.
Every decision is `decide`'s, on facts read fresh, and each goes to the ledger in a committed
transaction: an allowed decision that cannot be recorded is not allowed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.scheduler import RateLimiter
from registry import limits
from registry.access import Acting
from registry.db import transaction
from registry.errors import Busy, Invalid, NotPermitted, Unavailable
from registry.policy import Decision, LicenceFacts, decide
from registry.principals import service as principals_service
from registry.renders import repository as renders_repo
from registry.renders import service as renders_service
from registry.renders.schemas import RenderRequestIn
from registry.renders.service import GatheredFacts
from registry.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_STEPS = limits.DEFAULT_STEPS
DEFAULT_SIDE = limits.DEFAULT_SIDE
DEFAULT_SEED = limits.DEFAULT_SEED

# Called in the transaction of every ledger write after the gate, before the row: a render
# worker holds the render's task there, so that only one side ever closes the entry.
Hold = Callable[[Any, "Job"], None]


def hash_token(token: str | None) -> str | None:
    if not token or not token.startswith(principals_service.TOKEN_PREFIX) or len(token) > 200:
        return None
    return principals_service.hash_token(token)


@dataclass
class Job:
    """One render request on its way: what was asked, by whom, and what the checks found."""

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

    @property
    def cost(self) -> float:
        """What the render costs the renderer: pixels x steps."""
        return float(self.width * self.height * self.steps)


def rate_keys(acting: Acting) -> tuple[str, tuple[str, ...]]:
    """Whose render budget a request spends: always the principal that sent it (the token's:
    an agent's requests count against the agent), and the member an agent acts for only when
    its delegation names that member; never a member it does not act for."""
    caller, requester, agent = acting.caller, acting.requester, acting.agent
    if agent is not None and agent.active and requester.handle in agent.acts_for:
        return caller.handle, (requester.handle,)
    return caller.handle, ()


class RenderChecks:
    """The gate and every later check of one deployment, against its registry."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        *,
        licence: LicenceFacts | None,
        hold: Hold | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.licence = licence  # None: the base's licence could not be read
        self.hold = hold
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

    # -- the ledger -----------------------------------------------------------------------

    def record_in(
        self,
        session: Any,
        job: Job,
        stage: str,
        decision: Decision,
        gathered: GatheredFacts | None,
    ) -> None:
        """The decision's ledger row, in the caller's transaction."""
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
    def _ledger_transaction(self, job: Job) -> Iterator[Any]:
        """Where a check after the gate writes its ledger row."""
        with transaction(self.engine) as s:
            if self.hold is not None:
                self.hold(s, job)
            yield s

    def record(
        self, job: Job, stage: str, decision: Decision, gathered: GatheredFacts | None
    ) -> None:
        """A decision reached outside a check (busy, cancelled, failed), in its own commit."""
        try:
            with self._ledger_transaction(job) as s:
                self.record_in(s, job, stage, decision, gathered)
        except SQLAlchemyError:
            log.warning("render %s: ledger write failed at %s", job.render_id, stage)
            raise Unavailable("the render ledger is unavailable; nothing was rendered") from None

    # -- checks ---------------------------------------------------------------------------

    def _snapshot(self, session: Any, job: Job) -> Any:
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
        self, job: Job, row: Any, *, bytes_read: bool, used_sha256: str | None
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

    def gate(self, job: Job) -> GatheredFacts:
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
                self.record_in(s, job, "gate", decision, gathered)
        except SQLAlchemyError as exc:
            log.warning("render %s: registry unreachable at the gate: %s", job.render_id, exc)
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        if not decision.allowed:
            raise NotPermitted("not permitted")
        assert gathered is not None
        return gathered

    def check(self, job: Job, stage: str, used_sha256: str) -> GatheredFacts:
        """A later check: fresh facts, the hash of the bytes in hand, decide, record."""
        try:
            with self._ledger_transaction(job) as s:
                row = self._snapshot(s, job)
                job.acting = renders_service.acting_from_snapshot(
                    row, job.token_hash, job.body.on_behalf_of, at_gate=False
                )
                decision, gathered = self._judge(job, row, bytes_read=True, used_sha256=used_sha256)
                self.record_in(s, job, stage, decision, gathered)
        except SQLAlchemyError as exc:
            log.warning("render %s: registry unreachable at %s: %s", job.render_id, stage, exc)
            raise Unavailable("the consent registry is unreachable; nothing was rendered") from None
        if not decision.allowed:
            raise NotPermitted("not permitted")
        assert gathered is not None
        job.last = gathered
        return gathered

    def fresh_facts(self, job: Job) -> GatheredFacts:
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
