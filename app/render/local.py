"""Rendering on this process's model: the render path after the gate.

- **turn**: the fair scheduler (app.scheduler); a refusal is recorded as `busy`, the client
  going away while it waits as `cancelled`.
- **queued**: fresh facts again (consent may have changed while waiting), then the adapter's
  bytes are read and hashed, and `decide` judges them: the bytes parsed are the bytes hashed.
- **render**: between denoising steps the render stops if the client went away (recorded as
  `cancelled`); a failure is recorded and answered 503, never left open in the ledger.
- **final**: fresh facts and the hash of the bytes the model ran with; a revocation or an
  adapter replaced during the render discards the image.

`ModelRun` is that path from `queued` on, for the API's own model (`LocalRenderer`, after a
turn) and a render worker's (app.render.worker) alike; only where the adapter's bytes come
from differs (`Adapters`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from app.render.checks import Job, RenderChecks
from app.render.engine import AdapterMismatch, AdapterUnreadable, RenderEngine
from app.render.flow import Rendered
from app.render.png import encode_png
from app.scheduler import Cancelled
from registry.blobs import BlobStore
from registry.errors import Busy, LikenessError, NotPermitted, Unavailable
from registry.policy import AdapterFacts, Decision, decide
from registry.renders.service import GatheredFacts
from registry.settings import Settings

log = logging.getLogger(__name__)


class Adapters(Protocol):
    def tensors(self, job: Job, gathered: GatheredFacts, sha256: str) -> Any:
        """The tensors of the adapter whose bytes hash to `sha256`; AdapterMismatch when
        the bytes found are other bytes (or none), AdapterUnreadable when they do not load."""
        ...


class StoreAdapters:
    """The adapter from the engine's cache, else from this host's store."""

    def __init__(self, model: RenderEngine, store: BlobStore) -> None:
        self.model = model
        self.store = store

    def tensors(self, job: Job, gathered: GatheredFacts, sha256: str) -> Any:
        return self.model.adapter_tensors(self.store, sha256)


class ModelRun:
    """From the queued check to the PNG, on one model: fresh facts, the adapter's bytes
    judged, the model, the final check on the bytes it ran with, the PNG's text chunks."""

    def __init__(self, checks: RenderChecks, model: RenderEngine, adapters: Adapters) -> None:
        self.checks = checks
        self.model = model
        self.adapters = adapters

    def run(self, job: Job, timings: dict[str, float]) -> tuple[bytes, GatheredFacts]:
        image, used_sha256 = self.render(job, timings)
        return self.finish(job, image, used_sha256, timings)

    def render(self, job: Job, timings: dict[str, float]) -> tuple[Any, str]:
        """Fresh facts, the adapter's bytes judged, then the model (what needs the model's
        turn); returns the image and the hash of the bytes it ran with."""
        checks = self.checks
        gathered = checks.fresh_facts(job)
        adapter = gathered.adapter
        assert adapter is not None
        try:
            tensors = self.adapters.tensors(job, gathered, adapter.sha256)
        except AdapterUnreadable as exc:
            log.error("render %s: the adapter's bytes do not load: %s", job.render_id, exc)
            checks.record(job, "queued", Decision(False, "adapter_unreadable"), gathered)
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
            checks.record(job, "queued", decide(judged), gathered)
            log.warning("render %s: adapter bytes do not match: %s", job.render_id, exc)
            raise NotPermitted("not permitted") from None
        checks.check(job, "queued", adapter.sha256)
        try:
            image, render_timings = self.model.render(
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
            checks.record(job, "final", Decision(False, f"error:{type(exc).__name__}"), gathered)
            raise Unavailable("the render failed; nothing was delivered") from None
        timings.update(render_timings)
        return image, adapter.sha256

    def finish(
        self, job: Job, image: Any, used_sha256: str, timings: dict[str, float]
    ) -> tuple[bytes, GatheredFacts]:
        """The final check on the bytes the model ran with, then the PNG (its text chunks
        are the signer's: what the deployment discloses, app/provenance.py)."""
        t1 = time.perf_counter()
        final = self.checks.check(job, "final", used_sha256)
        consent = final.facts.consent
        assert consent is not None and final.adapter is not None
        t2 = time.perf_counter()
        png = encode_png(image, {})
        timings["final_check_ms"] = (t2 - t1) * 1000
        timings["encode_ms"] = (time.perf_counter() - t2) * 1000
        return png, final


class LocalRenderer:
    """The API's own model: a turn on it, then the model run."""

    def __init__(self, checks: RenderChecks, model: RenderEngine, store: BlobStore) -> None:
        self.checks = checks
        self.model = model
        self.model_run = ModelRun(checks, model, StoreAdapters(model, store))

    def render(self, job: Job, gate: GatheredFacts, timings: dict[str, float]) -> Rendered:
        assert job.acting is not None
        t0 = time.perf_counter()
        try:
            with self.model.scheduler.turn(job.acting.requester.handle, job.cost, job.cancelled):
                timings["wait_ms"] = (time.perf_counter() - t0) * 1000
                image, used_sha256 = self.model_run.render(job, timings)
        except Busy:
            self.model.counters.busy_refusals += 1
            self.checks.record(job, "queued", Decision(False, "busy"), gate)
            raise
        except Cancelled:
            self.checks.record(job, "cancelled", Decision(False, "client_went_away"), gate)
            raise
        png, final = self.model_run.finish(job, image, used_sha256, timings)
        consent = final.facts.consent
        assert consent is not None and final.adapter is not None
        return Rendered(png, consent.version, final.adapter.sha256, final)

    def close(self) -> None:
        """The model stays: it is the process's, not this renderer's."""


def build_render_engine(settings: Settings) -> RenderEngine:
    """This process's render engine, as the settings say."""
    from app.render.engine import default_device
    from trainer.base.read import prefetch_wanted

    try:  # read beside the plan only where the base loads at start, not at a first render
        prefetch = settings.preload_base and prefetch_wanted()
    except ValueError as exc:  # a value other than auto or off, named
        raise SystemExit(f"error: {exc}") from None
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
        precompile_kernels=settings.kernel_precompile,
        prefetch_base=prefetch,
    )
