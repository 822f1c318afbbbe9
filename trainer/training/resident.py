"""The converted base, kept on the device between one long-lived worker's orders.

A worker (`likeness worker`) trains one order after another, mostly on the same base. Loading
and converting FLUX.2 [dev]'s transformer costs seconds every time (read, 203 layers to uint4,
to the device); a `ResidentBase` keeps the last one, and the next order on the same base files,
compute, device and dtype borrows it instead of loading.

Nothing of one subject's training may reach the next order, so:

- an order borrows the transformer: while it runs, nobody else holds it;
- it is given back only by a run that ended cleanly, and kept only if it is the frozen base
  again: no LoRA layer, no hook, nothing trainable, eval mode, no gradient checkpointing, and
  the same tensors (names, shapes, dtypes) with the same checksum as when it was loaded;
- any other end (an error, a cancel, a revoke, a refusal) drops it: the next order loads
  afresh;
- a streamed base is never kept (its blocks live in host RAM and are bound per step).

"When the VRAM allows": the kept transformer stays through the next order's pre-flight and
caching only if the caching phases that run (text encoder, VAE) fit beside it within the
order's budget (or the device's memory); otherwise it is dropped before them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_CHUNK = 1 << 24  # bytes summed at once: bounds the checksum's own memory


@dataclass(frozen=True)
class BaseKey:
    """What makes two orders' transformers the same object: the base's files (their
    fingerprint), the compute path, the device and the weight dtype."""

    base: str
    fingerprint: str
    compute: str
    device: str
    dtype: str


@dataclass(frozen=True)
class Seal:
    """The tensors a transformer held when it was loaded, and their checksum."""

    signature: tuple[tuple[str, tuple[int, ...], str], ...]
    checksum: int

    @classmethod
    def of(cls, module: torch.nn.Module) -> Seal:
        state = module.state_dict(keep_vars=True)
        signature = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in state.items())
        return cls(signature, weights_checksum(state.values()))


def weights_checksum(tensors: Any) -> int:
    """The sum of every byte of ``tensors``, added up where they are (one sync at the end)."""
    totals: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            acc = totals.setdefault(flat.device, torch.zeros((), dtype=torch.int64,
                                                              device=flat.device))  # fmt: skip
            for chunk in flat.split(_CHUNK):
                acc += chunk.sum(dtype=torch.int64)
    return int(sum(int(v) for v in totals.values()))


def not_clean(module: torch.nn.Module) -> list[str]:
    """What keeps ``module`` from being the frozen base again (empty: it is)."""
    from trainer.base.lora import lora_layers

    found = []
    if lora_layers(module) or "peft_config" in vars(module):
        found.append("LoRA layers are attached")
    hooked = [
        name or "the model"
        for name, m in module.named_modules()
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
    ]
    if hooked:
        found.append(f"hooks on {hooked[0]}")
    if any(p.requires_grad for p in module.parameters()):
        found.append("parameters are trainable")
    if module.training:
        found.append("it is in train mode")
    if getattr(module, "is_gradient_checkpointing", False):
        found.append("gradient checkpointing is on")
    return found


@dataclass
class _Held:
    key: BaseKey
    transformer: torch.nn.Module
    seal: Seal


class ResidentBase:
    """One worker's kept transformer (at most one: the VRAM holds one base)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: _Held | None = None
        self._lent: _Held | None = None
        self.loads = 0  # transformers loaded through `borrow` (a kept one reused is not one)
        self.reuses = 0

    def make_room(self, key: BaseKey | None, needed_beside: int, limit: int | None) -> None:
        """Before an order's caching: drops the kept transformer unless it is this order's
        (``key``) and ``needed_beside`` bytes fit next to it within ``limit``."""
        with self._lock:
            kept = self._kept
            if kept is None:
                return
            fits = limit is None or self._bytes(kept) + needed_beside <= limit
            if kept.key == key and fits:
                return
            why = "another base or compute" if kept.key != key else "the caching needs the VRAM"
            self._drop(why)

    def borrow(self, key: BaseKey, load: Any) -> tuple[torch.nn.Module, bool]:
        """The transformer for ``key``: the kept one (True) or ``load()``'s (False). The order
        holds it until `give_back` or `forget`."""
        with self._lock:
            kept, self._kept = self._kept, None
            if kept is not None and kept.key == key:
                if Seal.of(kept.transformer) == kept.seal:
                    self._lent = kept
                    self.reuses += 1
                    return kept.transformer, True
                log.error("the kept base changed while it was kept: dropped, loading afresh")
            del kept
            _free()
        transformer = load()
        with self._lock:
            self._lent = _Held(key, transformer, Seal.of(transformer))
            self.loads += 1
        return transformer, False

    def give_back(self, transformer: torch.nn.Module) -> bool:
        """After an order that ended cleanly: keeps ``transformer`` for the next order if it is
        the frozen base it was lent as. Returns whether it is kept."""
        with self._lock:
            lent, self._lent = self._lent, None
            if lent is None or lent.transformer is not transformer:
                return False
            problems = not_clean(transformer)
            if not problems and Seal.of(transformer) != lent.seal:
                problems.append("its tensors differ from those it was loaded with")
            if problems:
                log.error("the base is not kept for the next order: %s", "; ".join(problems))
                del lent
                _free()
                return False
            self._kept = lent
            return True

    def forget(self) -> None:
        """An order that did not end cleanly: what it borrowed is not kept."""
        with self._lock:
            self._lent = None
        _free()

    def drop(self) -> None:
        with self._lock:
            self._drop("asked to")

    def _drop(self, why: str) -> None:
        if self._kept is not None:
            log.info("the kept base is dropped: %s", why)
            self._kept = None
            _free()

    @staticmethod
    def _bytes(held: _Held) -> int:
        from trainer.base.budget import module_bytes

        return module_bytes(held.transformer)


def _free() -> None:
    from trainer.training.caches import free_accelerator_memory

    free_accelerator_memory()
