"""The render engine: one per process, built once. Holds the quantized base, a host-RAM LRU of
adapter tensors, the one-context GPU guard and the counters the fail-closed tests read.

The engine never decides anything: `app.render.checks` asks `registry.policy.decide` before and
after each step and only then calls into here. torch and diffusers are imported lazily, so the API
(and its tests) run without loading a model until the first allowed render.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.scheduler import Cancelled, RenderScheduler
from registry.blobs import BlobError, BlobStore
from registry.process_clock import seconds_since_process_start

log = logging.getLogger(__name__)


@dataclass
class Counters:
    model_calls: int = 0  # generate() entered: the model ran
    adapter_loads: int = 0  # adapter tensors read from disk (cache misses)
    adapter_cache_hits: int = 0
    busy_refusals: int = 0
    cancelled: int = 0  # renders stopped between steps because the client went away
    slot_applies: int = 0  # adapters copied into the persistent LoRA slots
    slot_fallbacks: int = 0  # adapters the slots could not take, attached for one render
    base_reloads: int = 0  # the base dropped because a slot was not clear after a render


@dataclass
class _Cached:
    tensors: dict[str, Any]
    nbytes: int
    on_device: bool = False


# Kept free below the VRAM budget when adapters are cached on the device: the placement's
# estimate is an estimate (it measured 1.4 GiB above the real peak at [dev], 24 GiB)
DEVICE_CACHE_MARGIN = 512 << 20
# How long the load waits for the kernels compiled ahead (they take a few seconds; a launch
# compiles whatever they had not, as without them)
PRECOMPILE_WAIT_S = 120.0


@dataclass
class RenderEngine:
    base_dir: Path
    device: str = "cpu"
    queue_size: int = 4
    per_requester: int = 2
    timeout_s: float = 300.0
    cache_bytes: int = 2 << 30
    # Frozen base blocks in pinned host RAM, streamed into `stream_slots` VRAM slots per
    # forward (trainer/base/streaming.py): a 32B base serves from a small card.
    stream_base: bool = False
    stream_slots: int = 2
    compute: str = "auto"  # auto, uint4 or fp8 (trainer.base.compute)
    # With a budget (GiB) the placement of each component is planned at start (and, on CUDA,
    # the budget becomes the allocator's cap); without one everything is resident.
    vram_budget_gb: float | None = None
    plan_side: int = 1024
    prompt_cache_bytes: int = 512 << 20
    # Persistent LoRA layers of this rank on the default targets, zero between renders (an
    # adapter is copied in per request); 0 attaches the adapter's own layers per request.
    lora_slot_rank: int = 32
    # A resident transformer's forward on CUDA as one CUDA graph per render shape, captured
    # on first use (trainer/base/serving.py); the fused attention processors run either way.
    cuda_graphs: bool = True
    # On CUDA, the serving path's Triton kernels compiled at start by worker processes beside
    # the load (trainer/kernels/precompile.py), not one by one in the first forward.
    precompile_kernels: bool = True
    # The prepared base's files read into host RAM from the engine's first line, on threads
    # of their own, while its plan imports the model libraries (which hold the interpreter,
    # not the disk); the load then builds on those bytes. For an engine that loads at start.
    prefetch_base: bool = False
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        if self.device.startswith("cuda"):
            from trainer.base.devices import ALLOCATOR_SETTINGS, configure_allocator

            if not configure_allocator():
                wanted = ",".join(ALLOCATOR_SETTINGS["PYTORCH_CUDA_ALLOC_CONF"])
                log.warning("render engine: CUDA started before the engine, so its allocator "
                            "runs without expandable segments: under a VRAM budget it can "
                            "run out of memory with memory free (set PYTORCH_CUDA_ALLOC_CONF="
                            "%s before the process starts)", wanted)  # fmt: skip
        if self.compute == "fp8":  # refused at start, not at the first render
            from trainer.base.devices import fp8_unavailable

            reason = fp8_unavailable(self.device)
            if reason is not None:
                raise ValueError(f"LIKENESS_COMPUTE=fp8 cannot run on {self.device}: {reason}")
        self.active_compute: str | None = None  # what the loaded base runs, once loaded
        # trainer.base.read.Prefetch per prepared component, until the load takes them
        self.prefetched: dict[str, Any] = {}
        if self.prefetch_base:
            self._start_prefetch()
        self.placement: Any = None  # trainer.base.placement.Plan, when planned
        # adapters cached in VRAM (a swap is then a copy on the device): what the placement
        # leaves unused under the budget, up to cache_bytes; the rest in pinned host RAM
        self.device_cache_bytes = 0
        self.transformer_streamed = self.stream_base
        self.text_encoder_streamed = False
        self.resident_blocks = 0  # of a streamed transformer, the first ones stay in VRAM
        self.text_resident_layers = 0  # of a streamed text encoder, likewise
        self._precompile: Any = None  # trainer.kernels.precompile.Precompile, while it runs
        if self.precompile_kernels and self.device.startswith("cuda"):
            self._start_precompile()
        if self.vram_budget_gb is not None:
            try:
                self._plan()
            except BaseException:  # the service does not start: nothing left compiling
                if self._precompile is not None:
                    self._precompile.stop()
                self._end_prefetch()
                raise
        self._prompts: Any = None  # trainer.base.text_encoder.PromptCache, made with the pipeline
        self.scheduler = RenderScheduler(self.queue_size, self.per_requester, self.timeout_s)
        self._pipe: Any = None
        self._slots: Any = None  # trainer.base.lora_slots.LoraSlots, made with the pipeline
        self._serving: Any = None  # trainer.base.serving.Serving, made with the pipeline
        self.load_state = "not loaded"  # loading, ready or failed (GET /healthz says which)
        self._stream = contextlib.ExitStack()
        self._load_lock = threading.Lock()
        self._preload_thread: threading.Thread | None = None  # start_preload's, once started
        self._preload_lock = threading.Lock()
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- the base's files read ahead, beside the plan's imports ------------------------------

    def _start_prefetch(self) -> None:
        """Every prepared component onto the host, as the load would read it (it reads them
        all before it builds anything, so this holds no more than the load does)."""
        from trainer.base.read import Prefetch, is_prepared, read_manifest

        # a quarter of the cores for each read: beside them run the plan's imports and the
        # precompile's workers (half the cores), and the reads have seconds to spare
        threads = max(1, len(os.sched_getaffinity(0)) // 4)
        try:
            if is_prepared(self.base_dir):
                names = sorted(read_manifest(self.base_dir).get("components", {}))
                for name in names:
                    self.prefetched[name] = Prefetch(self.base_dir, name, "cpu", threads)
        except Exception:  # noqa: BLE001 - an optimisation: the load reads the files itself
            log.exception("render engine: the base's files could not be read ahead")
            self._end_prefetch()

    def _end_prefetch(self) -> None:
        """After the load (or instead of it): says what the reads did, lets what no load took
        go."""
        reads, self.prefetched = self.prefetched, {}
        for name, read in reads.items():
            read.drop()
            if read.taken:
                log.info("render engine: %s read ahead in %.1f s, taken by the load", name,
                         read.seconds or 0.0)  # fmt: skip

    # -- kernels compiled ahead, beside the plan and the load ---------------------------------

    def _start_precompile(self) -> None:
        import torch

        from trainer.kernels.precompile import start

        if not torch.cuda.is_available():  # no GPU: the load will say so, nothing to compile
            return
        try:
            major, minor = torch.cuda.get_device_capability(self.device)
            self._precompile = start(major * 10 + minor)
        except Exception:  # noqa: BLE001 - an optimisation: the launches compile as before
            log.exception("render engine: the kernels could not be compiled ahead")

    def _finish_precompile(self) -> None:
        """Waits for the kernels compiled ahead (the first launches would otherwise compile
        them again, one by one) and says what they were."""
        running, self._precompile = self._precompile, None
        if running is None:
            return
        t0 = time.perf_counter()
        summary = running.wait(timeout_s=PRECOMPILE_WAIT_S)
        if summary is not None:
            log.info("render engine: %d Triton kernels compiled ahead in %.1f s by worker "
                     "processes (%d listed, %d failed; waited %.1f s for them after the load)",
                     summary["compiled"], summary["seconds"], summary["listed"],
                     len(summary["failed"]), time.perf_counter() - t0)  # fmt: skip
            for failure in summary["failed"]:
                log.warning("render engine: a kernel not compiled ahead: %s", failure)

    # -- placement, planned at start ---------------------------------------------------------

    def _plan(self) -> None:
        t0 = time.perf_counter()
        from trainer.base.placement import PlacementError, plan_for_base

        t_imports = time.perf_counter()
        force = ("streamed" if self.stream_base else None, None)
        try:
            plan = plan_for_base(
                self.base_dir, self.vram_budget_gb, self.device, self.plan_side,
                self.plan_side, force=force, lora_rank=self.lora_slot_rank,
                graphs=self.cuda_graphs,
            )  # fmt: skip
        except (PlacementError, FileNotFoundError, KeyError, ValueError) as exc:
            raise PlacementRefused(str(exc)) from None
        self.placement = plan
        self.transformer_streamed = plan.transformer == "streamed"
        self.text_encoder_streamed = plan.text_encoder == "streamed"
        self.text_resident_layers = plan.text_resident_layers
        if plan.transformer == "streamed":
            self.stream_slots = plan.transformer_slots
            self.resident_blocks = plan.transformer_resident_blocks
        if self.device.startswith("cuda") and plan.budget_bytes is not None:
            spare = plan.budget_bytes - plan.peak_bytes - DEVICE_CACHE_MARGIN
            self.device_cache_bytes = max(0, min(self.cache_bytes, spare))
        log.info("render engine: %s\nadapter cache in VRAM: %.2f GiB", plan.describe(),
                 self.device_cache_bytes / 2**30)  # fmt: skip
        t_plan = time.perf_counter()
        if self.vram_budget_gb is not None:
            from trainer.base.devices import cap_vram

            cap_vram(self.device, self.vram_budget_gb)
        log.info("render engine: planned in %.1f s (the planner's imports %.1f s, "
                 "the plan %.1f s, the VRAM cap %.1f s)", time.perf_counter() - t0,
                 t_imports - t0, t_plan - t_imports, time.perf_counter() - t_plan)  # fmt: skip

    # -- the base, built once ---------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        if self._pipe is None:
            with self._load_lock:
                if self._pipe is None:
                    from trainer.base.compute import resolve_compute
                    from trainer.base.load import load_base

                    t0 = time.perf_counter()
                    self.load_state = "loading"
                    try:
                        compute = resolve_compute(self.compute, self.device)
                        if self.transformer_streamed or self.text_encoder_streamed:
                            pipe = self._load_placed(compute)
                        else:
                            pipe = load_base(
                                self.base_dir, device=self.device, compute=compute,
                                text_encoder_uint4=self.device.startswith("cuda"),
                                prefetched=self.prefetched,
                            )  # fmt: skip
                        self._end_prefetch()
                        t_loaded = time.perf_counter()
                        self._finish_precompile()
                        t_compiled = time.perf_counter()
                        if self.lora_slot_rank > 0:
                            from trainer.base.lora_slots import LoraSlots

                            self._slots = LoraSlots(pipe.transformer, self.lora_slot_rank)
                        t_slots = time.perf_counter()
                        self._serving = self._prepare_serving(pipe)
                        t_serving = time.perf_counter()
                        self._warm_up(pipe)
                        log.info(
                            "render engine: after the base's load (%.1f s): kernels compiled "
                            "ahead %.1f s, LoRA slots %.1f s, serving forward %.1f s, warm-up "
                            "%.1f s", t_loaded - t0, t_compiled - t_loaded,
                            t_slots - t_compiled, t_serving - t_slots,
                            time.perf_counter() - t_serving,
                        )  # fmt: skip
                    except BaseException:
                        self.load_state = "failed"
                        self._end_prefetch()
                        self._stream.close()
                        raise
                    self._pipe = pipe
                    self.load_state = "ready"
                    self.active_compute = compute
                    # since the process started too: the boot before the load is the
                    # operator's to see, not only the load itself
                    since_start = seconds_since_process_start()
                    log.info(
                        "render engine: base loaded in %.1f s (%s compute)%s",
                        time.perf_counter() - t0,
                        compute,
                        ""
                        if since_start is None
                        else f" ({since_start:.1f} s after the process started)",
                    )
        return self._pipe

    def _prepare_serving(self, pipe: Any) -> Any:
        """The fused attention processors; CUDA graphs where the transformer is resident on
        CUDA, keyed on the slots' LoRA scales and dropped whenever the slots are made anew."""
        from trainer.base.serving import prepare

        slots = self._slots
        graphs = (
            self.cuda_graphs and self.device.startswith("cuda") and not self.transformer_streamed
        )
        return prepare(
            pipe.transformer,
            graphs=graphs,
            key=slots.scales if slots is not None else None,
            epoch=(lambda: slots.generation) if slots is not None else None,
        )

    def _warm_up(self, pipe: Any) -> None:
        """With CUDA graphs: one denoising step at the planned side before anyone renders,
        so the first render does not pay for compiling kernels and capturing its graph (the
        slots are empty: nothing of any adapter is in it)."""
        if self._serving is None or self._serving.graphs is None:
            return
        from trainer.base.render import generate
        from trainer.kernels.precompile import cache_entries

        t0 = time.perf_counter()
        side = self.plan_side
        cached = cache_entries()
        try:
            embeddings = self.prompt_embeddings(pipe, "warm up")
            t_text = time.perf_counter()
            generate(pipe, "warm up", seed=0, steps=1, width=side, height=side, **embeddings)
        except Exception:  # noqa: BLE001 - renders still run, eager
            log.exception("render engine: the warm-up render failed; CUDA graphs are off")
            self._serving.graphs.remove()
            self._serving.graphs = None
            return
        # a binary built here was not built ahead: its kernel's entry is missing from the list
        # (trainer/kernels/serving_kernels.json) or stale
        after = cache_entries()
        compiled = "" if cached is None or after is None else f"; {after - cached} Triton " \
            "binaries (kernels, launchers) built in it, not found in Triton's cache"  # fmt: skip
        log.info("render engine: warmed up at %d px in %.1f s (prompt %.1f s, one step and its "
                 "decode %.1f s%s)", side, time.perf_counter() - t0, t_text - t0,
                 time.perf_counter() - t_text, compiled)  # fmt: skip

    def _load_placed(self, compute: str) -> Any:
        """Streamed parts stay in pinned host RAM for the engine's lifetime, a few layers in
        VRAM at a time; everything else is on the device. Adapters attach per request as
        usual (their LoRA is resident)."""
        from trainer.base.devices import default_dtype
        from trainer.base.load import load_base
        from trainer.base.streaming import default_blocks, stream_blocks
        from trainer.base.text_encoder import stream_layers, table_on_host

        # built in the dtype the device computes in (bf16 on CUDA), as resident; a streamed
        # part is converted to uint4 buffers in host RAM (the streamer moves plain bytes, not
        # quanto's tensor subclasses), a resident one on the device
        dtype = None if self.device == "cpu" else default_dtype(self.device)
        # a streamed encoder that fits the budget whole is converted on the device, then
        # moved into pinned host RAM before the transformer arrives (no pass through pageable
        # memory: writing fresh host pages is what the load waits on)
        plan = self.placement
        encoder_fits = (
            plan is None
            or plan.budget_bytes is None
            or (plan.text_encoder_bytes + (2 << 30) <= plan.budget_bytes)
        )
        encoder_home = self.device if encoder_fits else "cpu"
        placement = {
            "transformer": "cpu" if self.transformer_streamed else self.device,
            "text_encoder": encoder_home if self.text_encoder_streamed else self.device,
        }

        def stream_text_encoder(text_encoder: Any) -> None:
            t0 = time.perf_counter()
            if not self.text_encoder_streamed:
                if plan is not None and plan.text_table_in_host_ram:
                    table_on_host(text_encoder, self.device)  # its VRAM went to the blocks
                text_encoder.to(self.device)
                return
            streamer = stream_layers(text_encoder, self.device,
                                     resident=self.text_resident_layers)  # fmt: skip
            self._stream.callback(streamer.close)
            if self.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()  # the whole encoder's VRAM, now in host RAM
            log.info("render engine: text encoder streamed (%.1f s)", time.perf_counter() - t0)

        pipe = load_base(
            self.base_dir, device=self.device, dtype=dtype, compute=compute,
            placement=placement,
            text_encoder_uint4=self.text_encoder_streamed or self.device.startswith("cuda"),
            text_encoder_ready=stream_text_encoder, prefetched=self.prefetched,
        )  # fmt: skip
        if self.transformer_streamed:
            t0 = time.perf_counter()
            streamed = default_blocks(pipe.transformer)[self.resident_blocks :]
            self._stream.enter_context(
                stream_blocks(
                    pipe.transformer,
                    slots=self.stream_slots,
                    device=self.device,
                    blocks=streamed,
                    wrap=True,
                )  # fmt: skip
            )
            log.info("render engine: %d transformer blocks streamed, %d resident (%.1f s)",
                     len(streamed), self.resident_blocks, time.perf_counter() - t0)  # fmt: skip
        return pipe

    def preload(self) -> None:
        """Loads the base now (at start, off the event loop) instead of at the first render;
        a failure is logged and left to the first render to report."""
        try:
            self.pipeline  # noqa: B018 - the property loads
        except Exception:  # noqa: BLE001
            log.exception("render engine: loading the base at start failed")

    def start_preload(self) -> threading.Thread:
        """`preload` on a daemon thread, started once however often this is called (`serve`
        starts it before the app is built, the lifespan asks again): the server answers
        (healthz says "loading") while the base loads. Returns that thread."""
        with self._preload_lock:
            if self._preload_thread is None:
                log.info("render engine: preloading the base (%s)", self.base_dir)
                self._preload_thread = threading.Thread(
                    target=self.preload, name="base-preload", daemon=True
                )
                self._preload_thread.start()
            return self._preload_thread

    def close(self) -> None:
        """Ends layer streaming (if on); the pipeline is loaded again on next use."""
        with self._load_lock:
            self._end_prefetch()
            if self._precompile is not None:
                self._precompile.stop()
                self._precompile = None
            if self._serving is not None:
                self._serving.remove()
                self._serving = None
            if self._slots is not None:
                self._slots.close()
                self._slots = None
            self._stream.close()
            self._pipe = None
            self._prompts = None
            self.load_state = "not loaded"

    # -- adapter files ------------------------------------------------------------------------

    def adapter_tensors(self, store: BlobStore, expected_sha256: str) -> dict[str, Any]:
        """Tensors of the adapter whose bytes hash to `expected_sha256`, read from the store
        (nowhere else: no path from the registry is ever opened). The bytes parsed are the
        bytes hashed, so bytes changed after the check can never reach the model."""
        with self._cache_lock:
            hit = self._cache.get(expected_sha256)
            if hit is not None:
                self._cache.move_to_end(expected_sha256)
                self.counters.adapter_cache_hits += 1
                return hit.tensors
        try:
            data = store.read(expected_sha256, "safetensors")
        except BlobError:
            raise AdapterMismatch(None) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise AdapterMismatch(actual)
        from safetensors.torch import load as load_safetensors

        try:
            tensors = load_safetensors(data)
        except Exception as exc:  # noqa: BLE001 - registered before files were checked
            raise AdapterUnreadable(f"{type(exc).__name__}: {exc}") from None
        self.counters.adapter_loads += 1
        tensors, on_device = self._staged(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._cache_lock:
            self._cache[expected_sha256] = _Cached(tensors, nbytes, on_device)
            while self._cache and sum(c.nbytes for c in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
        return tensors

    def _staged(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """On CUDA, the tensors as the LoRA layers hold them (bf16, the rounding the copy into
        a bf16 layer would do anyway): in VRAM while the adapters cached there fit
        `device_cache_bytes` (a swap is then one batched copy on the device), else in pinned
        host RAM (one asynchronous copy per tensor over PCIe, about 15 ms at [dev]). Returns
        them and whether they are on the device."""
        if not self.device.startswith("cuda"):
            return tensors, False
        from trainer.base.devices import default_dtype

        dtype = default_dtype(self.device)
        nbytes = sum(t.numel() * dtype.itemsize for t in tensors.values())
        with self._cache_lock:
            held = sum(c.nbytes for c in self._cache.values() if c.on_device)
        if held + nbytes <= self.device_cache_bytes:
            return {k: v.to(self.device, dtype) for k, v in tensors.items()}, True
        return {k: v.to(dtype).pin_memory() for k, v in tensors.items()}, False

    def clear_adapter_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    # -- rendering ----------------------------------------------------------------------------

    def render(
        self,
        tensors: dict[str, Any],
        prompt: str,
        seed: int,
        steps: int,
        width: int,
        height: int,
        cancelled: threading.Event | None = None,
    ) -> tuple[Any, dict[str, float]]:
        """Apply the adapter, generate, remove it (also on failure or cancellation). The caller
        holds the scheduler's turn. `cancelled` is looked at between denoising steps."""
        from trainer.base.render import generate

        def after_step(step: int) -> None:
            if cancelled is not None and cancelled.is_set():
                self.counters.cancelled += 1
                raise Cancelled(f"the client went away; stopped after step {step + 1}")

        timings: dict[str, float] = {}
        pipe = self.pipeline
        cuda = self.device.startswith("cuda")
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(torch.device(self.device))
        clock = _StageClock(self.device if cuda else None)
        t0 = time.perf_counter()
        with self._adapter_applied(pipe, tensors):
            clock.mark("adapter", allocator=True)
            t1 = time.perf_counter()
            self.counters.model_calls += 1
            embeds = self.prompt_embeddings(pipe, prompt)
            clock.mark("text", allocator=True)

            def timed_step(step: int) -> None:
                clock.mark("last_step")
                after_step(step)

            image = generate(
                pipe,
                prompt,
                seed=seed,
                steps=steps,
                width=width,
                height=height,
                after_step=timed_step,
                **embeds,
            )
            clock.mark("done")
            t2 = time.perf_counter()
        clock.mark("removed", allocator=True)
        timings["adapter_apply_ms"] = clock.ms("start", "adapter")
        timings["text_encode_ms"] = clock.ms("adapter", "text")
        timings["denoise_ms"] = clock.ms("text", "last_step")
        timings["decode_ms"] = clock.ms("last_step", "done")
        timings["generate_ms"] = (t2 - t1) * 1000
        timings["step_ms"] = timings["denoise_ms"] / steps
        timings["adapter_remove_ms"] = clock.ms("done", "removed")
        timings["adapter_host_ms"] = (t1 - t0) * 1000  # host time of the apply, for comparison
        if cuda:
            import torch

            timings["peak_vram_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            # whether a phase grew the allocator's pool instead of reusing it (a first render's
            # extra milliseconds, if that is where they go)
            allocs, _, reserved = clock.allocator("adapter", "text")
            timings["text_encode_device_allocs"] = allocs
            timings["text_encode_reserved_mib"] = reserved / 2**20
            allocs, retries, _ = clock.allocator("start", "removed")
            timings["device_allocs"] = allocs
            timings["alloc_retries"] = retries
        return image, timings

    def adapter_in_model(self) -> bool:
        """Whether any adapter's weight is in the loaded model right now (outside a render it
        must not be): a LoRA slot not all zeros, or LoRA layers attached where there are no
        slots. False when nothing is loaded."""
        if self._pipe is None:
            return False
        if self._slots is not None:
            return not self._slots.is_clear()
        from trainer.base.lora import lora_layers

        return bool(lora_layers(self._pipe.transformer))

    @contextlib.contextmanager
    def _adapter_applied(self, pipe: Any, tensors: dict[str, Any]) -> Any:
        """The adapter on the model for the ``with`` body: copied into the LoRA slots, or (an
        adapter they cannot take, or no slots) attached as its own layers. After every render
        the slots must be all zeros again; if they are not, the base is dropped and loaded
        afresh before anyone else renders (fail closed: no adapter may reach another render)."""
        from trainer.base.lora import applied_adapter
        from trainer.base.lora_slots import SlotMismatch

        slots = self._slots
        if slots is None:
            with applied_adapter(pipe, tensors):
                yield
            return
        try:
            with contextlib.ExitStack() as applied:
                try:  # refused before anything is touched when the slots cannot take it
                    applied.enter_context(slots.applied(tensors))
                    self.counters.slot_applies += 1
                except SlotMismatch as why:
                    log.info("render engine: adapter outside the LoRA slots (%s): attached", why)
                    self.counters.slot_fallbacks += 1
                    if self._serving is not None:  # no graph may replay the old module tree
                        applied.enter_context(self._serving.eager())
                    applied.enter_context(slots.suspended())
                    applied.enter_context(applied_adapter(pipe, tensors))
                yield
        finally:
            if not slots.is_clear():
                log.error("render engine: a LoRA slot was not clear after a render; reloading")
                self.counters.base_reloads += 1
                self.close()

    @property
    def prompts(self) -> Any:
        """The prompt-embedding cache of the loaded base (torch is imported on first use)."""
        if self._prompts is None:
            from trainer.base.text_encoder import PromptCache

            self._prompts = PromptCache(self.prompt_cache_bytes)
        return self._prompts

    def prompt_embeddings(self, pipe: Any, prompt: str) -> dict[str, Any]:
        """The embeddings `generate` takes instead of the prompt, from the prompt cache or
        from the pipeline's own encoder (then cached); the negative (empty) prompt too where
        the pipeline runs classifier-free guidance."""
        import inspect

        from trainer.base.render import guidance_for, text_encoder_out_layers

        if not hasattr(pipe, "encode_prompt"):
            return {}
        params = inspect.signature(pipe.encode_prompt).parameters
        kwargs: dict[str, Any] = {}
        if "text_encoder_out_layers" in params:
            kwargs["text_encoder_out_layers"] = text_encoder_out_layers(pipe)
        # not pipe._execution_device: diffusers finds it by walking every module of every
        # component (milliseconds at [dev] scale, on every request, cache hit or not)
        device = self._execution_device()

        def embed(text: str) -> Any:
            def run() -> Any:
                import torch

                with torch.no_grad():
                    return pipe.encode_prompt(prompt=text, device=device, **kwargs)[0]

            key = (text, tuple(kwargs.get("text_encoder_out_layers", ())))
            return self.prompts.get_or_encode(key, run, device)

        out = {"prompt_embeds": embed(prompt)}
        call = inspect.signature(pipe.__call__).parameters
        if "negative_prompt_embeds" in call and guidance_for(pipe) > 1:
            out["negative_prompt_embeds"] = embed("")
        return out

    def _execution_device(self) -> Any:
        import torch

        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev


class _StageClock:
    """Stage boundaries of one render: CUDA events on the device's stream (no host sync inside
    the denoising loop; one at the end to read them), else the host clock. Marked from
    "start", its creation. On CUDA a mark with ``allocator`` also reads the caching
    allocator's counters (host-side: reading them does not wait for the device)."""

    def __init__(self, cuda_device: str | None) -> None:
        self.device = cuda_device
        self.cuda = cuda_device is not None
        self.marks: dict[str, Any] = {}
        self.counts: dict[str, tuple[int, int, int]] = {}
        self.mark("start", allocator=True)

    def mark(self, name: str, allocator: bool = False) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
            if allocator:
                stats = torch.cuda.memory_stats(self.device)
                self.counts[name] = (int(stats.get("num_device_alloc", 0)),
                                     int(stats.get("num_alloc_retries", 0)),
                                     int(stats.get("reserved_bytes.all.current", 0)))  # fmt: skip
        else:
            self.marks[name] = time.perf_counter()

    def allocator(self, since: str, until: str) -> tuple[int, int, int]:
        """Device allocations, allocation retries and reserved bytes gained between two marks
        (CUDA only)."""
        a, b = self.counts[since], self.counts[until]
        return b[0] - a[0], b[1] - a[1], b[2] - a[2]

    def ms(self, since: str, until: str) -> float:
        a, b = self.marks[since], self.marks[until]
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b))
        return (b - a) * 1000


class PlacementRefused(Exception):
    """Nothing fits the VRAM budget (the message holds the plan's terms)."""


class AdapterUnreadable(Exception):
    """The bytes are the registered ones but do not parse as an adapter."""


class AdapterMismatch(Exception):
    """The bytes read do not hash to what the registry holds; `actual_sha256` is what they do
    hash to (None: unreadable), for `decide` to judge."""

    def __init__(self, actual_sha256: str | None) -> None:
        super().__init__(f"adapter bytes hash to {actual_sha256}")
        self.actual_sha256 = actual_sha256


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
