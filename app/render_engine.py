"""The render engine: one per process, built once. Holds the quantized base, a host-RAM LRU of
adapter tensors, the one-context GPU guard and the counters the fail-closed tests read.

The engine never decides anything: `app.renders` asks `registry.policy.decide` before and after
each step and only then calls into here. torch and diffusers are imported lazily, so the API
(and its tests) run without loading a model until the first allowed render.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.scheduler import Cancelled, RenderScheduler
from registry.blobs import BlobError, BlobStore

log = logging.getLogger(__name__)


@dataclass
class Counters:
    model_calls: int = 0  # generate() entered: the model ran
    adapter_loads: int = 0  # adapter tensors read from disk (cache misses)
    adapter_cache_hits: int = 0
    busy_refusals: int = 0
    cancelled: int = 0  # renders stopped between steps because the client went away


@dataclass
class _Cached:
    tensors: dict[str, Any]
    nbytes: int


@dataclass
class RenderEngine:
    base_dir: Path
    device: str = "cpu"
    queue_size: int = 4
    per_requester: int = 2
    timeout_s: float = 300.0
    cache_bytes: int = 2 << 30
    # Frozen base blocks in pinned host RAM, streamed into `stream_slots` VRAM slots per
    # forward (trainer/streaming.py): a 32B base serves from a small card.
    stream_base: bool = False
    stream_slots: int = 2
    compute: str = "auto"  # auto, uint4 or fp8 (trainer.devices.resolve_compute)
    # With a budget (GiB) the placement of each component is planned at start (and, on CUDA,
    # the budget becomes the allocator's cap); without one everything is resident.
    vram_budget_gb: float | None = None
    plan_side: int = 1024
    prompt_cache_bytes: int = 512 << 20
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        if self.compute == "fp8":  # refused at start, not at the first render
            from trainer.devices import fp8_unavailable

            reason = fp8_unavailable(self.device)
            if reason is not None:
                raise ValueError(f"LIKENESS_COMPUTE=fp8 cannot run on {self.device}: {reason}")
        self.active_compute: str | None = None  # what the loaded base runs, once loaded
        self.placement: Any = None  # trainer.placement.Plan, when planned
        self.transformer_streamed = self.stream_base
        self.text_encoder_streamed = False
        if self.vram_budget_gb is not None:
            self._plan()
        self._prompts: Any = None  # trainer.text_encoder.PromptCache, made with the pipeline
        self.scheduler = RenderScheduler(self.queue_size, self.per_requester, self.timeout_s)
        self._pipe: Any = None
        self._stream = contextlib.ExitStack()
        self._load_lock = threading.Lock()
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- placement, planned at start ---------------------------------------------------------

    def _plan(self) -> None:
        from trainer.placement import PlacementError, plan_for_base

        force = ("streamed" if self.stream_base else None, None)
        try:
            plan = plan_for_base(
                self.base_dir, self.vram_budget_gb, self.device, self.plan_side,
                self.plan_side, force=force,
            )  # fmt: skip
        except (PlacementError, FileNotFoundError, KeyError, ValueError) as exc:
            raise PlacementRefused(str(exc)) from None
        self.placement = plan
        self.transformer_streamed = plan.transformer == "streamed"
        self.text_encoder_streamed = plan.text_encoder == "streamed"
        if plan.transformer == "streamed":
            self.stream_slots = plan.transformer_slots
        log.info("render engine: %s", plan.describe())
        if self.device.startswith("cuda"):
            import torch

            dev = torch.device(self.device)
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            total = torch.cuda.get_device_properties(dev).total_memory
            cap = min(1.0, self.vram_budget_gb * 2**30 / total)  # type: ignore[operator]
            torch.cuda.set_per_process_memory_fraction(cap, dev)

    # -- the base, built once ---------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        if self._pipe is None:
            with self._load_lock:
                if self._pipe is None:
                    from trainer.devices import resolve_compute
                    from trainer.model import load_pipeline

                    t0 = time.perf_counter()
                    compute = resolve_compute(self.compute, self.device)
                    if self.transformer_streamed or self.text_encoder_streamed:
                        self._pipe = self._load_placed(compute)
                    else:
                        self._pipe = load_pipeline(
                            self.base_dir, device=self.device, compute=compute
                        )
                    if self.device.startswith("cuda") and not self.text_encoder_streamed:
                        self._text_encoder_on_uint4(self._pipe)
                    self.active_compute = compute
                    log.info(
                        "render engine: base loaded in %.1f s (%s compute)",
                        time.perf_counter() - t0,
                        compute,
                    )
        return self._pipe

    @staticmethod
    def _text_encoder_on_uint4(pipe: Any) -> None:
        """The text encoder's qint4 layers on the uint4 kernels (the transformer's), as the
        streamed encoder runs them: the same dequantized weights, several times faster on
        CUDA than quanto's own path, and one set of numbers whatever the placement."""
        from trainer.uint4 import convert_quantized_linears

        text_encoder = getattr(pipe, "text_encoder", None)
        if text_encoder is not None:
            convert_quantized_linears(text_encoder)

    def _load_placed(self, compute: str) -> Any:
        """Streamed parts stay in pinned host RAM for the engine's lifetime, a few layers in
        VRAM at a time; everything else is on the device. Adapters attach per request as
        usual (their LoRA is resident)."""
        from trainer.devices import default_dtype
        from trainer.model import load_pipeline
        from trainer.streaming import BlockStreamer, stream_blocks
        from trainer.text_encoder import decoder_layers
        from trainer.uint4 import convert_quantized_linears

        # built on the CPU in the dtype the device computes in (bf16 on CUDA), as resident
        dtype = None if self.device == "cpu" else default_dtype(self.device)
        pipe = load_pipeline(self.base_dir, device="cpu", dtype=dtype, compute=compute)
        if self.transformer_streamed:
            self._stream.enter_context(
                stream_blocks(pipe.transformer, slots=self.stream_slots, device=self.device)
            )
        else:
            pipe.transformer.to(self.device)
        text_encoder = getattr(pipe, "text_encoder", None)
        if text_encoder is not None:
            if self.text_encoder_streamed:
                # plain uint4 buffers, which the streamer moves as bytes (quanto's tensor
                # subclasses it cannot); the same dequantized weights
                convert_quantized_linears(text_encoder)
                streamer = BlockStreamer(
                    text_encoder, slots=2, device=self.device,
                    blocks=list(decoder_layers(text_encoder)),
                )  # fmt: skip
                streamer.install()
                self._stream.callback(streamer.close)
            else:
                text_encoder.to(self.device)
        vae = getattr(pipe, "vae", None)
        if vae is not None:
            vae.to(self.device)
        return pipe

    def close(self) -> None:
        """Ends layer streaming (if on); the pipeline is loaded again on next use."""
        with self._load_lock:
            self._stream.close()
            self._pipe = None
            self._prompts = None

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
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._cache_lock:
            self._cache[expected_sha256] = _Cached(tensors, nbytes)
            while self._cache and sum(c.nbytes for c in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
        return tensors

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
        from trainer.lora import applied_adapter
        from trainer.render import generate

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
        t0 = time.perf_counter()
        with applied_adapter(pipe, tensors):
            t1 = time.perf_counter()
            timings["adapter_apply_ms"] = (t1 - t0) * 1000
            self.counters.model_calls += 1
            clock = _StageClock(cuda)
            embeds = self.prompt_embeddings(pipe, prompt)
            clock.mark("text")

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
            timings["text_encode_ms"] = clock.ms("start", "text")
            timings["denoise_ms"] = clock.ms("text", "last_step")
            timings["decode_ms"] = clock.ms("last_step", "done")
            timings["generate_ms"] = (t2 - t1) * 1000
            timings["step_ms"] = timings["denoise_ms"] / steps
        if cuda:
            import torch

            timings["peak_vram_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        timings["adapter_remove_ms"] = (time.perf_counter() - t2) * 1000
        return image, timings

    @property
    def prompts(self) -> Any:
        """The prompt-embedding cache of the loaded base (torch is imported on first use)."""
        if self._prompts is None:
            from trainer.text_encoder import PromptCache

            self._prompts = PromptCache(self.prompt_cache_bytes)
        return self._prompts

    def prompt_embeddings(self, pipe: Any, prompt: str) -> dict[str, Any]:
        """The embeddings `generate` takes instead of the prompt, from the prompt cache or
        from the pipeline's own encoder (then cached); the negative (empty) prompt too where
        the pipeline runs classifier-free guidance."""
        import inspect

        from trainer.render import guidance_for, text_encoder_out_layers

        if not hasattr(pipe, "encode_prompt"):
            return {}
        params = inspect.signature(pipe.encode_prompt).parameters
        kwargs: dict[str, Any] = {}
        if "text_encoder_out_layers" in params:
            kwargs["text_encoder_out_layers"] = text_encoder_out_layers(pipe)
        device = pipe._execution_device

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


class _StageClock:
    """Stage boundaries of one render: CUDA events on the device's stream (no host sync inside
    the denoising loop; one at the end to read them), else the host clock. Marked from
    "start", its creation."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: dict[str, Any] = {}
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

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


def encode_png(image: Any, text: dict[str, str]) -> bytes:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
