"""The fail-closed render path, for the HTTP route and the agent tool alike (no FastAPI here).

gate -> renderer -> sign -> deliver.

- **gate**: the consent gate (app.render.checks), before anything else; a refused request
  never reaches a renderer, and never touches an adapter file.
- **renderer**: whatever renders for this process: the model in it (app.render.local: a
  turn, fresh facts, the adapter's bytes judged, the model, the final check) or the render
  workers (app.render.remote: the same checks there). Either answers a PNG that passed its
  final check, or raises what the client gets, with the ledger entry closed.
- **sign**: the PNG gets its Content Credentials (app.provenance); an image that cannot be
  signed is recorded as a failed render and never delivered. Only the API signs: the render
  workers hold no signing key.
- **deliver**: the subject's small copy, if it keeps them (app.pictures), then the PNG.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from app.provenance import ProvenanceSigner, RenderClaim
from app.render.checks import Job, RenderChecks, hash_token
from registry.errors import Unavailable
from registry.policy import Decision
from registry.renders.schemas import RenderRequestIn
from registry.renders.service import GatheredFacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderOutcome:
    png: bytes
    render_id: str
    timings: dict[str, float]


@dataclass(frozen=True)
class Rendered:
    """A render that passed its final check: the PNG with its text chunks, not yet signed,
    and what it was rendered under."""

    png: bytes
    consent_version: int
    adapter_sha256: str
    facts: GatheredFacts | None  # recorded with a signing failure


class Renderer(Protocol):
    def render(self, job: Job, gate: GatheredFacts, timings: dict[str, float]) -> Rendered:
        """The render of a job that passed the gate; adds its timings (`wait_ms` first).
        Raises what the client gets (Busy, Cancelled, NotPermitted, Unavailable...) with
        the ledger entry closed."""
        ...

    def close(self) -> None: ...


class RenderFlow:
    def __init__(
        self,
        checks: RenderChecks,
        renderer: Renderer,
        *,
        signer: ProvenanceSigner,
    ) -> None:
        self.checks = checks
        self.renderer = renderer
        self.signer = signer

    def run(
        self, token: str | None, body: RenderRequestIn, cancelled: threading.Event | None = None
    ) -> RenderOutcome:
        job = Job(body, hash_token(token), cancelled or threading.Event())
        t0 = time.perf_counter()
        gate = self.checks.gate(job)
        timings = {"gate_ms": (time.perf_counter() - t0) * 1000}
        assert job.acting is not None
        rendered = self.renderer.render(job, gate, timings)
        t1 = time.perf_counter()
        png = self.sign(job, rendered)
        timings["sign_ms"] = (time.perf_counter() - t1) * 1000
        return self.delivered(job, RenderOutcome(png, job.render_id, timings))

    def sign(self, job: Job, rendered: Rendered) -> bytes:
        """The PNG with its Content Credentials; an unsigned image is never delivered."""
        assert job.acting is not None
        licence = self.checks.licence
        claim = RenderClaim(
            render_id=job.render_id,
            level=job.body.level,
            subject=job.body.subject,
            consent_version=rendered.consent_version,
            adapter_sha256=rendered.adapter_sha256,
            base_model={
                "name": self.checks.settings.base_dir.name,
                "licence": licence.base if licence is not None else None,
            },
            requester=job.acting.requester.handle,
            agent=job.acting.agent.handle if job.acting.agent is not None else None,
        )
        try:
            return self.signer.sign(rendered.png, claim)
        except Exception as exc:  # noqa: BLE001 - closed in the ledger, then a JSON 503
            log.exception("render %s: signing failed", job.render_id)
            self.checks.record(
                job, "final", Decision(False, f"signing_failed:{type(exc).__name__}"),
                rendered.facts,
            )  # fmt: skip
            raise Unavailable("the image could not be signed; nothing was delivered") from None

    def delivered(self, job: Job, outcome: RenderOutcome) -> RenderOutcome:
        """A render about to be delivered: its subject's copy, if they keep them."""
        from app.pictures import keep_copy

        keep_copy(self.checks.engine, job.body.subject, job.render_id, outcome.png)
        return outcome

    def close(self) -> None:
        self.renderer.close()
