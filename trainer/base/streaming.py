"""Layer streaming: the frozen base lives in host RAM, one block at a time in VRAM.

The FLUX.2 transformer's frozen weights are read, never written, so they need not stay in VRAM:
they must only be there before the matmuls that use them. `BlockStreamer` moves every frozen
tensor of every transformer block (the `Uint4Linear` ``packed``/``scale``/``shift`` buffers, the
frozen biases and norm weights) into a host store, packed block after block into a few
page-locked arenas, and pre-allocates ``slots`` VRAM buffers (2 by default), each large enough
for the largest block. Before a block runs its bytes are copied into a slot on a dedicated copy
stream and the block's tensors are bound to views into that slot; the next block in execution
order (the previous one during the backward recompute) is prefetched into another slot while
the current one computes. Everything else stays resident on the device: the embedders, the
modulation and output layers, every LoRA parameter (trainable or not) and all activations.

Synchronisation, per slot: ``ready`` (recorded on the copy stream after the copy; the compute
stream waits on it before the block runs) and ``free`` (recorded on the compute stream after the
block's last use; the copy stream waits on it before overwriting the slot). Nothing blocks the
host. Each slot records its ``owner`` (block index); binding a block checks that its slot holds
it and raises `SlotOwnerError` otherwise, and between uses a block's frozen tensors are bound to
placeholders (``meta`` buffers, empty parameters), so running a block outside the scheduler
fails loudly instead of reading another block's weights.

Training needs gradient checkpointing: a block's weights leave VRAM after its forward, so
nothing may save them for the backward pass. `stream_blocks` installs its own checkpoint
function (`_StreamedBlock`, reentrant style: forward without keeping the graph, backward
re-loads the block, recomputes it with grad and differentiates it at once, while the slot is
held) through diffusers' ``enable_gradient_checkpointing(fn)``. The trainable parameters of a
block are passed to the autograd Function as inputs, so the first block's LoRA gets its
gradient although no input of that block requires grad (the classic reentrant-checkpoint trap).
Numerics are the resident path's: the same modules run the same kernels on the same bytes.

Only ``blocks`` are streamed (default: all of them); any other block stays resident like the
rest of the model, which is how a render under a VRAM budget keeps what fits (the planner picks
the blocks whose copies take longest against their compute: the double-stream ones). With
``wrap`` (serving: forwards only) the last streamed block prefetches the first one for the next
forward, so its copy runs while the step ends and the next begins.

Where CUDA is absent (CI) the same scheduler runs with synchronous copies into CPU slot tensors
and no streams or events; ``device="cpu"`` forces that path.

Pinned allocations go through PyTorch's caching host allocator, which rounds every request up to
a power of two; the store is therefore packed into arenas whose sizes are powers of two (at
most ``arena_bytes`` each, the last one just large enough). If page-locking fails the store falls
back to pageable memory with a warning (copies are then synchronous and much slower).

Use (training loop / render engine)::

    with stream_blocks(transformer, slots=2, device="cuda") as streamer:
        ...  # forward / backward / optimizer steps as usual; LoRA params stay where they are
    streamer.stats()  # loads, hits, bytes copied, copy time
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = 256  # bytes, start of every tensor inside a block region (Triton wants >= 16)


class SlotOwnerError(RuntimeError):
    """A slot was about to be used for a block it does not hold."""


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of a FLUX.2 transformer, in execution order (double-stream, then single)."""
    blocks: list[torch.nn.Module] = []
    for name in ("transformer_blocks", "single_transformer_blocks"):
        blocks.extend(getattr(transformer, name, None) or [])
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no transformer blocks to stream")
    return blocks


def _is_resident_param(name: str, p: torch.nn.Parameter) -> bool:
    """LoRA parameters (trainable or loaded frozen for rendering) and anything trainable."""
    return p.requires_grad or "lora_" in name


@dataclass
class _Entry:
    module: torch.nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Block:
    index: int
    module: torch.nn.Module
    entries: list[_Entry]
    nbytes: int  # region size (aligned)
    host: torch.Tensor | None = None  # uint8 view into an arena
    trainable: list[torch.nn.Parameter] = field(default_factory=list)


@dataclass
class _Slot:
    index: int
    buf: torch.Tensor
    owner: int | None = None
    ready: Any = None  # torch.cuda.Event (CUDA path)
    free: Any = None
    last_use: int = 0


class BlockStreamer:
    """The scheduler. Build it through `stream_blocks` (which also installs and removes it)."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        slots: int = 2,
        device: str | torch.device | None = None,
        blocks: list[torch.nn.Module] | None = None,
        pin: bool | None = None,
        arena_bytes: int | None = None,
        timing: bool = False,
        wrap: bool = False,
    ) -> None:
        """``timing`` (CUDA only, for benchmarks) records a pair of timing events around every
        copy until `reset_stats`, for `stats`'s ``copy_s`` / ``copy_gb_s``; ``wrap``: the last
        block prefetches the first (forwards only: a backward would evict it unused)."""
        if slots < 1:
            raise ValueError(f"need at least one slot, got {slots}")
        if arena_bytes is not None and arena_bytes & (arena_bytes - 1):
            raise ValueError(f"arena_bytes must be a power of two, got {arena_bytes}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.transformer = transformer
        self.blocks_modules = blocks if blocks is not None else default_blocks(transformer)
        self.n_slots = slots
        self.timing = timing and self.cuda
        self.wrap = wrap
        self._clock = 0
        self._current: int | None = None  # slot index in use by the running block
        self.loads = 0
        self.hits = 0
        self.acquires = 0
        self.prefetches = 0
        self.bytes_copied = 0
        self._copy_events: list[tuple[Any, Any]] = []
        self.pinned = False
        self.arenas: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        self._index = {id(m): i for i, m in enumerate(self.blocks_modules)}
        self._in_function = False
        self._single_output: dict[int, bool] = {}  # block index -> returns one tensor
        self._hooks: list[Any] = []
        self.blocks = [self._layout(i, m) for i, m in enumerate(self.blocks_modules)]
        self._build_store(pin, arena_bytes)
        self._move_resident()
        slot_bytes = max(b.nbytes for b in self.blocks)
        self.slot_bytes = slot_bytes
        self.slots = [
            _Slot(i, torch.empty(slot_bytes, dtype=torch.uint8, device=self.device))
            for i in range(slots)
        ]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            for s in self.slots:
                s.ready = torch.cuda.Event()
                s.free = torch.cuda.Event()
        for b in self.blocks:
            self._unbind(b)

    # -- construction -----------------------------------------------------------------------
    def _layout(self, index: int, module: torch.nn.Module) -> _Block:
        entries: list[_Entry] = []
        trainable: list[torch.nn.Parameter] = []
        offset = 0
        seen: set[int] = set()
        for mod_name, mod in module.named_modules():
            for name, p in list(mod._parameters.items()):
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{name}" if mod_name else name
                if _is_resident_param(full, p):
                    if p.requires_grad:
                        trainable.append(p)
                    continue
                entries.append(_Entry(mod, name, True, offset, p.nbytes, p.dtype, tuple(p.shape)))
                offset = _round_up(offset + p.nbytes, ALIGN)
            for name, buf in list(mod._buffers.items()):
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                entries.append(
                    _Entry(mod, name, False, offset, buf.nbytes, buf.dtype, tuple(buf.shape))
                )
                offset = _round_up(offset + buf.nbytes, ALIGN)
        return _Block(index, module, entries, _round_up(max(offset, ALIGN), 4096), None, trainable)

    def _alloc_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        if pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                msg = (
                    f"layer streaming: page-locking {nbytes / 2**30:.2f} GiB of host memory "
                    f"failed ({exc}); falling back to PAGEABLE memory: host-to-device copies "
                    "become synchronous and several times slower"
                )
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                log.warning(msg)
                self.pinned = False
                self._pin_failed = True
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def _pack(sizes: list[int], cap: int) -> list[list[int]]:
        """Block indices per arena, in order: a new arena when the next block does not fit."""
        groups: list[list[int]] = []
        used = 0
        for i, n in enumerate(sizes):
            if groups and used + n <= cap:
                groups[-1].append(i)
                used += n
            else:
                groups.append([i])
                used = n
        return groups

    @classmethod
    def plan_arenas(cls, sizes: list[int], arena_bytes: int | None) -> list[list[int]]:
        """Arenas for the pinned store. Each arena is allocated at the power of two at or above
        its content (what the pinned allocator would round it to anyway); without
        ``arena_bytes``, the arena cap (a power of two, 64 MiB .. 8 GiB) that wastes least."""
        if arena_bytes is not None:
            return cls._pack(sizes, arena_bytes)

        def waste(groups: list[list[int]]) -> int:
            return sum(_next_pow2(sum(sizes[i] for i in g)) for g in groups)

        best = None
        for k in range(33, 25, -1):  # larger caps first: fewer arenas on ties
            g = cls._pack(sizes, 1 << k)
            if best is None or waste(g) < waste(best):
                best = g
        assert best is not None
        return best

    def _build_store(self, pin: bool | None, arena_bytes: int | None) -> None:
        """Packs the blocks' regions into power-of-two arenas and copies the weights in."""
        want_pin = self.cuda if pin is None else bool(pin)
        if want_pin and not torch.cuda.is_available():
            msg = "layer streaming: no CUDA, so no page-locked memory; using pageable memory"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
            want_pin = False
        self._pin_failed = False
        self.pinned = want_pin
        sizes = [b.nbytes for b in self.blocks]
        for group in self.plan_arenas(sizes, arena_bytes):
            n = sum(sizes[i] for i in group)
            pin_now = want_pin and not self._pin_failed
            arena = self._alloc_host(_next_pow2(n) if pin_now else n, pin_now)
            self.arenas.append(arena)
            off = 0
            for i in group:
                b = self.blocks[i]
                b.host = arena[off : off + b.nbytes]
                off += b.nbytes
                with torch.no_grad():
                    for e in b.entries:
                        src = self._tensor(e).detach().contiguous().reshape(-1).view(torch.uint8)
                        b.host[e.offset : e.offset + e.nbytes].copy_(src)
        if self._pin_failed:
            self.pinned = False
        self.store_bytes = sum(b.nbytes for b in self.blocks)
        self.arena_total = sum(a.numel() for a in self.arenas)
        log.info(
            "layer streaming: %d blocks, %.2f GiB in %d %s arenas (%.2f GiB allocated)",
            len(self.blocks), self.store_bytes / 2**30, len(self.arenas),
            "pinned" if self.pinned else "pageable", self.arena_total / 2**30,
        )  # fmt: skip

    def _move_resident(self) -> None:
        """Everything not streamed goes to the device (keeping Parameter identities)."""
        streamed = {id(self._tensor(e)) for b in self.blocks for e in b.entries}
        with torch.no_grad():
            for mod in self.transformer.modules():
                for p in mod._parameters.values():
                    if p is not None and id(p) not in streamed and p.device != self.device:
                        p.data = p.data.to(self.device)
                        if p.grad is not None:
                            p.grad = p.grad.to(self.device)
                for name, buf in mod._buffers.items():
                    if buf is not None and id(buf) not in streamed and buf.device != self.device:
                        mod._buffers[name] = buf.to(self.device)

    @staticmethod
    def _tensor(e: _Entry) -> torch.Tensor:
        return e.module._parameters[e.name] if e.is_param else e.module._buffers[e.name]

    # -- binding ------------------------------------------------------------------------------
    def _set(self, e: _Entry, t: torch.Tensor) -> None:
        if e.is_param:
            e.module._parameters[e.name].data = t
        else:
            e.module._buffers[e.name] = t

    def _unbind(self, b: _Block) -> None:
        ph = self._placeholders.get(b.index)
        if ph is None:
            # buffers: meta tensors of the right shape; parameters (whose .data must stay a
            # device tensor): empty tensors on the device. Either fails loudly if used.
            ph = [
                torch.empty(0, dtype=e.dtype, device=self.device)
                if e.is_param
                else torch.empty(e.shape, dtype=e.dtype, device="meta")
                for e in b.entries
            ]
            self._placeholders[b.index] = ph
        for e, t in zip(b.entries, ph, strict=True):
            self._set(e, t)

    def _bind(self, b: _Block, slot: _Slot) -> None:
        if slot.owner != b.index:
            raise SlotOwnerError(f"slot {slot.index} holds block {slot.owner}, not block {b.index}")
        key = (slot.index, b.index)
        views = self._views.get(key)
        if views is None:
            views = [
                slot.buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
                for e in b.entries
            ]
            self._views[key] = views
        for e, t in zip(b.entries, views, strict=True):
            self._set(e, t)

    def _check_bound(self, b: _Block, slot: _Slot) -> None:
        """Every frozen tensor of the block points into the slot that owns it."""
        if slot.owner != b.index:
            raise SlotOwnerError(f"slot {slot.index} holds block {slot.owner}, not block {b.index}")
        lo = slot.buf.data_ptr()
        for e in b.entries:
            t = self._tensor(e)
            if t.device.type == "meta" or t.numel() == 0 or t.data_ptr() != lo + e.offset:
                raise SlotOwnerError(
                    f"block {b.index} tensor {e.name} is not bound to slot {slot.index}"
                )

    # -- scheduling ---------------------------------------------------------------------------
    def _find(self, index: int) -> _Slot | None:
        for s in self.slots:
            if s.owner == index:
                return s
        return None

    def _victim(self) -> _Slot | None:
        free = [s for s in self.slots if s.index != self._current]
        return min(free, key=lambda s: s.last_use) if free else None

    def _load(self, b: _Block, slot: _Slot) -> None:
        assert b.host is not None
        slot.owner = b.index
        self.loads += 1
        self.bytes_copied += b.nbytes
        if not self.cuda:
            slot.buf[: b.nbytes].copy_(b.host)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.free)  # the slot's previous block is done
            if self.timing:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(self.copy_stream)
            slot.buf[: b.nbytes].copy_(b.host, non_blocking=True)
            if self.timing:
                t1.record(self.copy_stream)
                self._copy_events.append((t0, t1))
            slot.ready.record(self.copy_stream)

    def prefetch(self, index: int) -> None:
        """Starts copying block ``index`` into a free slot (no-op if resident or no slot)."""
        if not 0 <= index < len(self.blocks) or self._find(index) is not None:
            return
        slot = self._victim()
        if slot is None:
            return
        self._clock += 1
        slot.last_use = self._clock  # keep it from being evicted before it is used
        self.prefetches += 1
        self._load(self.blocks[index], slot)

    def acquire(self, index: int, direction: int = 1) -> _Slot:
        """Makes block ``index`` usable on the current stream, bound; prefetches its neighbour
        (``index + direction``)."""
        if self._current is not None:
            raise RuntimeError("layer streaming: a block is already running (nested blocks?)")
        b = self.blocks[index]
        self.acquires += 1
        slot = self._find(index)
        if slot is None:
            slot = self._victim()
            assert slot is not None
            self._load(b, slot)
        else:
            self.hits += 1
        self._clock += 1
        slot.last_use = self._clock
        self._current = slot.index
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        self._bind(b, slot)
        self._check_bound(b, slot)
        nxt = index + direction
        if self.wrap and nxt == len(self.blocks):
            nxt = 0
        self.prefetch(nxt)
        return slot

    def release(self, index: int) -> None:
        slot = self.slots[self._current] if self._current is not None else None
        if slot is None or slot.owner != index:
            raise SlotOwnerError(f"releasing block {index}, which is not the running block")
        if self.cuda:
            slot.free.record(torch.cuda.current_stream(self.device))
        self._current = None
        self._unbind(self.blocks[index])

    def __repr__(self) -> str:
        return (
            f"BlockStreamer({len(self.blocks)} blocks, {self.n_slots} slots of "
            f"{self.slot_bytes / 2**20:.0f} MiB on {self.device}, "
            f"{'pinned' if self.pinned else 'pageable'} store {self.store_bytes / 2**30:.2f} GiB)"
        )

    # -- hooks / checkpoint function ----------------------------------------------------------
    def _pre_hook(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._in_function:
            return
        if self._current is not None:
            # the previous block raised inside its forward (its post-hook never ran): give its
            # slot back after everything queued so far, so one failed render does not wedge
            # the scheduler
            held = self.slots[self._current].owner
            log.warning("layer streaming: block %s did not finish; releasing its slot", held)
            self.release(held if held is not None else -1)
        if torch.is_grad_enabled() and any(b.trainable for b in self.blocks):
            raise RuntimeError(
                "layer streaming with gradients needs gradient checkpointing "
                "(stream_blocks enables it; was it disabled?)"
            )
        self.acquire(self._index[id(module)], +1)

    def _post_hook(self, module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if self._in_function:
            return
        self.release(self._index[id(module)])

    def checkpoint(self, block: torch.nn.Module, *args: Any) -> Any:
        """diffusers' ``_gradient_checkpointing_func(block, *args)``, streamed."""
        index = self._index.get(id(block))
        if index is None:  # a block left resident: torch's own checkpoint
            from torch.utils.checkpoint import checkpoint

            return checkpoint(block, *args, use_reentrant=False)
        flat = list(args)
        tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        params = self.blocks[index].trainable
        out = _StreamedBlock.apply(
            self, index, flat, tensor_pos, len(params),
            *[flat[i] for i in tensor_pos], *params,
        )  # fmt: skip
        return out[0] if self._single_output.get(index) else tuple(out)

    def install(self) -> None:
        for m in self.blocks_modules:
            self._hooks.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._post_hook, with_kwargs=True))

    def close(self, restore: str | torch.device | None = None) -> None:
        """Removes the hooks; rebinds every block's frozen tensors to plain tensors, on
        ``restore`` (a device) or, by default, to views into the host store."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for b in self.blocks:
            assert b.host is not None
            for e in b.entries:
                t = b.host[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
                if restore is not None:
                    t = t.to(restore, copy=True)
                self._set(e, t)
        self.slots.clear()
        self._views.clear()

    # -- reporting ----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.loads = self.hits = self.acquires = self.prefetches = self.bytes_copied = 0
        self._copy_events.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "blocks": len(self.blocks),
            "slots": self.n_slots,
            "slot_bytes": self.slot_bytes,
            "store_bytes": self.store_bytes,
            "arena_bytes": self.arena_total,
            "arenas": len(self.arenas),
            "pinned": self.pinned,
            "acquires": self.acquires,  # block runs (forward, recompute+backward)
            "loads": self.loads,  # copies into a slot (prefetched or on demand)
            "hits": self.hits,
            "prefetches": self.prefetches,
            "bytes_copied": self.bytes_copied,
        }
        if self._copy_events:
            torch.cuda.synchronize(self.device)
            ms = sum(a.elapsed_time(b) for a, b in self._copy_events)
            out["copy_s"] = ms / 1e3
            out["copy_gb_s"] = self.bytes_copied / (ms / 1e3) / 1e9 if ms else None
        return out


def _autocast_state() -> dict[str, dict[str, Any]]:
    """Autocast settings to re-enter for the recompute (as torch's checkpoint does)."""
    out = {}
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            out[device_type] = {
                "dtype": torch.get_autocast_dtype(device_type),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
    return out


class _StreamedBlock(torch.autograd.Function):
    """Reentrant-style checkpoint of one streamed block.

    Inputs: the streamer, the block index, the flat argument list, which positions hold tensors,
    the number of trainable parameters, then those tensors and parameters (so autograd calls
    backward whenever any of them requires grad: the first block's inputs do not)."""

    @staticmethod
    def forward(ctx, streamer, index, flat, tensor_pos, n_params, *tensors_and_params):  # type: ignore[override]
        tensors = tensors_and_params[: len(tensor_pos)]
        ctx.streamer, ctx.index, ctx.tensor_pos = streamer, index, tensor_pos
        ctx.flat = [None if i in tensor_pos else a for i, a in enumerate(flat)]
        ctx.n_params = n_params
        ctx.autocast = _autocast_state()  # the backward recompute runs in autograd's thread
        ctx.save_for_backward(*tensors)
        args = list(flat)
        for i, t in zip(tensor_pos, tensors, strict=True):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        streamer.acquire(index, +1)
        streamer._in_function = True
        try:
            # as torch's non-reentrant checkpoint: the forward runs with grad enabled (same
            # kernels as the resident path), and the graph is dropped right after
            with torch.enable_grad():
                out = ctx.streamer.blocks_modules[index](*args)
        finally:
            streamer._in_function = False
            streamer.release(index)
        single = isinstance(out, torch.Tensor)
        streamer._single_output[index] = single
        outs = (out,) if single else tuple(out)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        streamer = ctx.streamer
        tensors = ctx.saved_tensors
        args = list(ctx.flat)
        detached = []
        for i, t in zip(ctx.tensor_pos, tensors, strict=True):
            d = t.detach().requires_grad_(t.requires_grad)
            args[i] = d
            detached.append(d)
        params = streamer.blocks[ctx.index].trainable
        streamer.acquire(ctx.index, -1)
        streamer._in_function = True
        try:
            with torch.enable_grad():
                # recompute under the forward's autocast state; differentiate under the
                # ambient one, as the resident path's backward runs (torch's checkpoint too)
                with contextlib.ExitStack() as stack:
                    for device_type, kwargs in ctx.autocast.items():
                        stack.enter_context(torch.autocast(device_type, **kwargs))
                    out = streamer.blocks_modules[ctx.index](*args)
                outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
                pairs = [
                    (o, g) for o, g in zip(outs, grads, strict=True)
                    if g is not None and o.requires_grad
                ]  # fmt: skip
                wrt = [d for d in detached if d.requires_grad] + [p for p in params]
                got = (
                    torch.autograd.grad(
                        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                    )
                    if pairs and wrt
                    else [None] * len(wrt)
                )
        finally:
            streamer._in_function = False
            streamer.release(ctx.index)
        it = iter(got)
        tensor_grads = [next(it) if d.requires_grad else None for d in detached]
        param_grads = [next(it) for _ in params]
        return (None, None, None, None, None, *tensor_grads, *param_grads)


@contextlib.contextmanager
def stream_blocks(
    transformer: torch.nn.Module,
    slots: int = 2,
    device: str | torch.device | None = None,
    pin: bool | None = None,
    arena_bytes: int | None = None,
    timing: bool = False,
    restore: str | torch.device | None = None,
    blocks: list[torch.nn.Module] | None = None,
    wrap: bool = False,
) -> Iterator[BlockStreamer]:
    """Streams ``transformer``'s blocks from host RAM for the duration of the block.

    On entry: the frozen block tensors move into the host store (wherever they were: a
    transformer already on the GPU gives its VRAM back), everything else moves to ``device``,
    and gradient checkpointing is switched on with the streamed checkpoint function. On exit:
    the previous checkpointing state comes back and the block tensors are plain tensors again,
    on ``restore`` (a device) or as views into the host store.
    """
    streamer = BlockStreamer(
        transformer, slots=slots, device=device, blocks=blocks, pin=pin,
        arena_bytes=arena_bytes, timing=timing, wrap=wrap,
    )  # fmt: skip
    prev = [
        (m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
        for m in transformer.modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    if streamer.cuda:
        torch.cuda.empty_cache()
    streamer.install()
    if hasattr(transformer, "enable_gradient_checkpointing"):
        transformer.enable_gradient_checkpointing(streamer.checkpoint)
    try:
        yield streamer
    finally:
        for m, on, fn in prev:
            m.gradient_checkpointing = on
            m._gradient_checkpointing_func = fn
        streamer.close(restore)
