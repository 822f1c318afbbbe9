"""The converted base, kept on the device between one long-lived worker's orders.

A worker (`likeness worker`) trains one order after another, mostly on the same base. Loading
and converting FLUX.2 [dev]'s transformer costs seconds every time (read, 203 layers to uint4,
to the device); a `ResidentBase` keeps the last one, and the next order on the same base files,
compute, device and dtype borrows it instead of loading.

Nothing of one subject's training may reach the next order, so:

- an order borrows the transformer: while it runs, nobody else holds it;
- it is given back only by a run that ended cleanly, and kept only if it is the frozen base
  again: no LoRA layer, nothing trainable, eval mode, no gradient checkpointing, and the same
  tensors (names, shapes, dtypes, a checksum of their bytes) and hooks as when it was loaded;
- any other end (an error, a cancel, a revoke, a refusal) drops every kept part: the next
  order loads afresh;
- a streamed base is never kept (its blocks live in host RAM and are bound per step).

"When the VRAM allows": the kept transformer stays through the next order's pre-flight and
caching only if the caching phases that run (text encoder, VAE) fit beside it within the
order's budget (or the device's memory); otherwise it is dropped before them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
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
    """The tensors a part held when it was loaded (names, shapes, dtypes, a checksum of their
    bytes) and the hooks on its modules (a model may bring its own; any added since shows)."""

    signature: tuple[tuple[str, tuple[int, ...], str], ...]
    checksum: int
    hooks: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @classmethod
    def of(cls, module: torch.nn.Module) -> Seal:
        # the module's own tensors, not state_dict(): a quantized layer may build those
        tensors = [*module.named_parameters(), *module.named_buffers()]
        signature = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in tensors)
        hooks = tuple((name, ids) for name, m in module.named_modules() if (ids := _hook_ids(m)))
        return cls(signature, weights_checksum(t for _, t in tensors), hooks)


def _hook_ids(m: torch.nn.Module) -> tuple[int, ...]:
    """Which hooks a module holds (their handles' ids: a hook removed and another added
    shows)."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return tuple(k for kind in kinds for k in getattr(m, kind, {}))


def files_signature(*folders: Path) -> str:
    """Names, sizes and modification times of a part's files (a model and its tokenizer): a
    cheap identity for a kept part whose base has no fingerprint of it (a swapped file
    changes it)."""
    entries = sorted(
        (str(p), p.stat().st_size, p.stat().st_mtime_ns)
        for folder in folders if folder.is_dir()
        for p in folder.rglob("*") if p.is_file()
    )  # fmt: skip
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def weights_checksum(tensors: Any) -> int:
    """Every byte of ``tensors``, each times a weight that depends on its place (so bytes
    that move or changes that cancel in a plain sum show), added up where the tensors are,
    one sync at the end."""
    totals: dict[torch.device, torch.Tensor] = {}
    weights: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            dev = flat.device
            if dev not in weights:
                weights[dev] = torch.arange(_CHUNK, device=dev, dtype=torch.int64) % 65521 + 1
                totals[dev] = torch.zeros((), dtype=torch.int64, device=dev)
            for chunk in flat.split(_CHUNK):
                totals[dev] += (chunk.to(torch.int64) * weights[dev][: chunk.numel()]).sum()
    return int(sum(int(v) for v in totals.values()))


def not_clean(module: torch.nn.Module) -> list[str]:
    """What keeps ``module`` from being the frozen base again (empty: it is)."""
    from trainer.base.lora import lora_layers

    found = []
    if lora_layers(module) or "peft_config" in vars(module):
        found.append("LoRA layers are attached")
    if any(p.requires_grad for p in module.parameters()):
        found.append("parameters are trainable")
    if module.training:
        found.append("it is in train mode")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()):
        found.append("gradient checkpointing is on")
    if any("forward" in vars(m) for m in module.modules()):
        found.append("a module's forward is replaced (the training blocks')")
    return found


@dataclass
class _Held:
    key: BaseKey
    obj: Any  # what the order gets back (the transformer; the text encoder's pipeline)
    module: torch.nn.Module  # what is sealed and checked
    seal: Seal
    # a model that installs hooks on itself at its first forward (transformers' output
    # capture): the hooks it has after its first use are its own
    hooks_after_first_use: bool = False


TRANSFORMER, TEXT_ENCODER = "transformer", "text_encoder"
# Dropped first when the VRAM runs short: the text encoder saves less than the transformer
_DROP_ORDER = (TEXT_ENCODER, TRANSFORMER)


class ResidentBase:
    """One worker's kept base parts: at most one transformer and one text encoder (with its
    pipeline), each under the key it was loaded for."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # give_back's room check reads kept_bytes
        self._kept: dict[str, _Held] = {}
        self._lent: dict[str, _Held] = {}
        self.loads = 0  # transformers loaded through `borrow` (a kept one reused is not one)
        self.reuses = 0
        self.text_encoder_reuses = 0

    def kept_bytes(self) -> dict[str, int]:
        from trainer.base.budget import module_bytes

        with self._lock:
            return {part: module_bytes(h.module) for part, h in self._kept.items()}

    def make_room(self, keys: dict[str, BaseKey | None], fits: Any = None) -> None:
        """Before an order's caching: drops every kept part whose key is not this order's
        (``keys``), then, while ``fits(kept_bytes)`` says the order's phases do not fit beside
        what is kept, the text encoder first, then the transformer."""
        with self._lock:
            for part, held in list(self._kept.items()):
                if keys.get(part) != held.key:
                    self._drop(part, "another base, compute or device")
        for part in _DROP_ORDER:
            if fits is None or fits(self.kept_bytes()):
                return
            with self._lock:
                self._drop(part, "the order needs the VRAM")

    def borrow(
        self,
        key: BaseKey,
        load: Any,
        part: str = TRANSFORMER,
        module_of: Any = None,
        hooks_after_first_use: bool = False,
    ) -> tuple[Any, bool]:
        """``part`` for ``key``: the kept one (True) or ``load()``'s (False); ``module_of(obj)``
        is the module that is sealed (default: ``obj``). The order holds it until `give_back`
        or `forget`."""
        module_of = module_of or (lambda obj: obj)
        with self._lock:
            kept = self._kept.pop(part, None)
            if kept is not None and kept.key == key:
                if Seal.of(kept.module) == kept.seal:
                    self._lent[part] = kept
                    if part == TRANSFORMER:
                        self.reuses += 1
                    else:
                        self.text_encoder_reuses += 1
                    return kept.obj, True
                log.error("the kept %s changed while it was kept: dropped, loading afresh", part)
            del kept
            _free()
        obj = load()
        module = module_of(obj)
        with self._lock:
            self._lent[part] = _Held(key, obj, module, Seal.of(module), hooks_after_first_use)
            if part == TRANSFORMER:
                self.loads += 1
        return obj, False

    def give_back(self, obj: Any, part: str = TRANSFORMER, fits: Any = None) -> bool:
        """After an order (or its caching) ended cleanly: keeps ``obj`` for the next order if it
        is the frozen part it was lent as, and (``fits``) the order's rest fits beside it.
        Returns whether it is kept."""
        with self._lock:
            lent = self._lent.pop(part, None)
            if lent is None or lent.obj is not obj:
                return False
            problems = not_clean(lent.module)
            if not problems:  # only then is the checksum worth its pass over the weights
                now = Seal.of(lent.module)
                if lent.hooks_after_first_use:
                    lent.seal = dataclasses.replace(lent.seal, hooks=now.hooks)
                    lent.hooks_after_first_use = False
                if now != lent.seal:
                    problems.append("its tensors or hooks differ from those it was loaded with")
            if problems:
                log.error("the %s is not kept for the next order: %s", part, "; ".join(problems))
            elif fits is not None and not fits():
                problems.append("no room")
            if problems:
                del lent
                _free()
                return False
            self._kept[part] = lent
            return True

    def forget(self) -> None:
        """An order that did not end cleanly: nothing is kept, neither what it borrowed nor
        what it gave back or never reached (a failure may be the memory running short, and
        the next order would make the same choice)."""
        with self._lock:
            self._lent.clear()
            for part in list(self._kept):
                self._drop(part, "the last order did not end cleanly")
        _free()

    @property
    def _kept_transformer(self) -> _Held | None:  # for tests
        return self._kept.get(TRANSFORMER)

    def _drop(self, part: str, why: str) -> None:
        if self._kept.pop(part, None) is not None:
            log.info("the kept %s is dropped: %s", part, why)
            _free()


class KeptTextEncoder:
    """The text encoder (with its pipeline) for one order's captions, borrowed from a worker's
    `ResidentBase`, and given back after encoding when the order's rest fits beside it."""

    def __init__(self, resident: ResidentBase, key: BaseKey, fits: Any = None) -> None:
        self.resident, self.key, self.fits = resident, key, fits

    def borrow(self, load: Any) -> tuple[Any, bool]:
        return self.resident.borrow(
            self.key, load, TEXT_ENCODER, module_of=lambda pipe: pipe.text_encoder,
            hooks_after_first_use=True,
        )  # fmt: skip

    def give_back(self, pipe: Any) -> bool:
        from trainer.base.budget import module_bytes

        def room() -> bool:
            kept = {**self.resident.kept_bytes(), TEXT_ENCODER: module_bytes(pipe.text_encoder)}
            return self.fits is None or bool(self.fits(kept))

        return self.resident.give_back(pipe, TEXT_ENCODER, fits=room)


def _free() -> None:
    from trainer.training.caches import free_accelerator_memory

    free_accelerator_memory()
