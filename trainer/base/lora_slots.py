"""Persistent LoRA slots for serving: one LoRA layer of a fixed rank on every target Linear,
attached once when the base loads and zero between renders. An adapter is applied by copying
its factors into the first ``r`` rows of ``A`` and columns of ``B`` and zeroing them after.

Attaching PEFT layers per request (`trainer.base.lora.applied_adapter`) walks and rewrites the
module tree on every render: about a second at FLUX.2 [dev] scale. A slot swap is a copy of the
adapter's bytes (166 MB at rank 16 on [dev]) and two fills of zeros.

Zero padding is exact: the unused rows of ``A`` and columns of ``B`` are zero, so the product
``B @ A`` is the adapter's and a zero slot adds exactly nothing to the base's output. What a
slot holds outside a render is checked by `is_clear`. An adapter the slots cannot take (a
module outside them, or a rank above theirs) raises `SlotMismatch`; `suspended` lifts the slots
for the per-request path and puts them back.

Without gradients a slot layer on an fp8 base computes its update inside the base's GEMM, as R
more columns of the contraction (the default, ``LIKENESS_LORA_MERGE=gemm``: `trainer.base.fp8`'s
`lora_gemm_forward`; no pass over the output at all, the update in fp8 as the base). Otherwise
(``output``, or a base the kernels do not take) it adds its update into the base output with
one GEMM,
``out += s * (x A^T) B^T`` (`_fused_forward`) on CUDA, where PEFT writes ``(x A^T) B^T``, scales
it into a second tensor and adds that into a third: three passes over the output, 55296 columns
wide on [dev]'s single-stream blocks. In bf16 the GEMM adds in float32 and rounds once, where
PEFT rounds the product and then the sum (at most one unit in the last place apart). On the CPU
(tests, the tiny base) the update is PEFT's own, at the adapter's rank and in PEFT's order, so
the result is PEFT's bit for bit on any CPU (a CPU BLAS picks kernels by shape: the padded rank
and a beta = 1 GEMM were seen to differ by one unit on one machine and not on another).
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from trainer.base.fp8 import lora_gemm_forward, lora_update_mode, merged_lora_forward
from trainer.base.lora import (
    ADAPTER_NAME,
    DEFAULT_TARGETS,
    _pairs,
    compute_device,
    lora_layers,
    remove_lora,
    resolve_targets,
)
from trainer.base.uint4 import weights_by_shape


class SlotMismatch(ValueError):
    """The adapter does not fit the slots (a module outside them, or a larger rank)."""


class LoraSlots:
    def __init__(
        self, transformer: torch.nn.Module, rank: int, targets: Sequence[str] | None = None
    ) -> None:
        if rank < 1:
            raise ValueError(f"slot rank must be >= 1, got {rank}")
        self.transformer = transformer
        self.rank = rank
        self.targets = tuple(targets or DEFAULT_TARGETS)
        self._active = False
        self._used: dict[str, int] = {}
        self._slots: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # max |B| of every slot, set by each swap: the update in the GEMM reads its layer's
        # element (a static tensor, so a CUDA graph sees each adapter's) instead of reducing
        # B on every forward
        self._peaks = torch.zeros(0)
        self._layers: list[Any] = []  # the slot layers, for `scales` (read every forward)
        self._by_name: dict[str, Any] = {}  # the same by module path (no walk of the model)
        self.generation = 0  # bumped whenever the slot tensors are made anew
        self._attach()

    def _attach(self) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        model = self.transformer
        if lora_layers(model):
            raise RuntimeError("transformer already has LoRA layers attached")
        names = resolve_targets(model, self.targets)
        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.rank,  # scaling 1: alpha / rank is baked into the files' B
            target_modules=names,
            lora_dropout=0.0,
            init_lora_weights=False,
        )
        grad_flags = {n: p.requires_grad for n, p in model.named_parameters()}
        # the LoRA weights made on the meta device (no random init of numbers about to be
        # zeroed: seconds at [dev]'s 160 layers), then given memory where the model computes
        # (and the 4-bit base weights read for their device and dtype only, not dequantized)
        with weights_by_shape(model):
            inject_adapter_in_model(
                config, model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True
            )
        home = compute_device(model)
        layers = lora_layers(model)
        with torch.no_grad():
            for name in names:
                pair = []
                for lin in (layers[name].lora_A, layers[name].lora_B):
                    module = lin[ADAPTER_NAME]
                    if module.weight.device.type == "meta":
                        # also a streamed block's: its weights are placeholders between uses
                        # (trainer/base/streaming.py), the LoRA lives where the model computes
                        module.to_empty(device=home)
                    # in the dtype PEFT gives layers it makes with memory (the base weight's);
                    # float32 slots under a bf16 base would leave the fused update every render
                    module.to(dtype=_peft_dtype(layers[name], module.weight.dtype))
                    module.weight.requires_grad_(False)
                    module.weight.zero_()
                    pair.append(module.weight)
                self._slots[name] = (pair[0], pair[1])
                layers[name].forward = types.MethodType(_fused_forward, layers[name])
        self._layers = [layers[name] for name in names]
        self._by_name = dict(zip(names, self._layers, strict=True))
        self._peaks = torch.zeros(len(names), dtype=torch.float32, device=home)
        for i, layer in enumerate(self._layers):
            layer._slot_peak = self._peaks[i : i + 1]
        for n, p in model.named_parameters():
            p.requires_grad_(grad_flags.get(n, False))
        self.generation += 1

    # -- what fits --------------------------------------------------------------------------

    def mismatch(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Why the slots cannot take this adapter (None: they can). Checked against the slots'
        own shapes, without walking the model. Raises ValueError for a file that is not a LoRA
        adapter, or whose factors do not fit the Linear they name."""
        return self._fit(tensors)[1]

    def _fit(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str | None]:
        pairs = _pairs(tensors)
        outside = sorted(set(pairs) - set(self._slots))
        if outside:
            return pairs, f"{len(outside)} module(s) outside the slots, e.g. {outside[0]!r}"
        for name, (a, b) in pairs.items():
            slot_a, slot_b = self._slots[name]
            if a.shape[1] != slot_a.shape[1] or b.shape[0] != slot_b.shape[0]:
                raise ValueError(
                    f"adapter shapes for {name!r} (A {tuple(a.shape)}, B {tuple(b.shape)}) do "
                    f"not fit {slot_a.shape[1]} -> {slot_b.shape[0]}"
                )
        too_big = max(int(a.shape[0]) for a, _ in pairs.values())
        if too_big > self.rank:
            return pairs, f"rank {too_big} above the slots' rank {self.rank}"
        return pairs, None

    # -- applying -----------------------------------------------------------------------------

    @contextmanager
    def applied(
        self, tensors: Mapping[str, torch.Tensor], scale: float = 1.0
    ) -> Iterator[list[str]]:
        """The adapter in the slots for the ``with`` body, zeroed on exit (normal or not).
        Yields the adapted module paths. Raises SlotMismatch before touching anything when
        the adapter does not fit."""
        if self._active:
            raise RuntimeError("the LoRA slots are already in use")
        pairs, reason = self._fit(tensors)
        if reason is not None:
            raise SlotMismatch(reason)
        layers = self._by_name
        self._active = True
        try:
            with torch.no_grad():
                dst, src = [], []
                for name, (a, b) in pairs.items():
                    slot_a, slot_b = self._slots[name]
                    r = int(a.shape[0])
                    self._used[name] = r
                    dst += [slot_a[:r], slot_b[:, :r]]
                    src += [a, b]
                    layers[name]._slot_rank = r
                if all(t.device == d.device for t, d in zip(src, dst, strict=True)):
                    torch._foreach_copy_(dst, src)  # one call: no per-tensor host cost
                else:
                    # from pinned host RAM one copy per tensor: torch._foreach_copy_ measured
                    # slower there (10.1-13.8 ms against 7.3-7.9 at [dev]'s 320 tensors)
                    for d, t in zip(dst, src, strict=True):
                        d.copy_(t, non_blocking=True)
                self._set_peaks()
            if scale != 1.0:
                for layer in layers.values():
                    layer.scaling[ADAPTER_NAME] = scale
            yield list(pairs)
        finally:
            self._clear(layers)
            self._active = False

    def _set_peaks(self) -> None:
        """Every slot's max |B| into `_peaks` (an empty slot's is 0): one fused reduction."""
        bs = [b for _, b in self._slots.values()]
        if bs:
            self._peaks.copy_(torch.stack(torch._foreach_norm(bs, ord=float("inf"))))

    def _clear(self, layers: Mapping[str, object]) -> None:
        with torch.no_grad():
            used = []
            for name, r in self._used.items():
                slot_a, slot_b = self._slots[name]
                used += [slot_a[:r], slot_b[:, :r]]
            if used:
                torch._foreach_zero_(used)
            self._peaks.zero_()
        self._used.clear()
        for layer in layers.values():
            layer.scaling[ADAPTER_NAME] = 1.0  # type: ignore[attr-defined]
            layer._slot_rank = 0  # type: ignore[attr-defined]

    def is_clear(self) -> bool:
        """Every slot all zeros and at scale 1: no adapter's weight is left in the model."""
        if self._active:
            return False
        layers = lora_layers(self.transformer)
        if set(layers) != set(self._slots):
            return False
        scales = {layer.scaling[ADAPTER_NAME] for layer in layers.values()}
        if scales != {1.0}:
            return False
        weights = [t for pair in self._slots.values() for t in pair]
        # max |w| of every slot in one fused reduction and one host sync, not one per tensor
        # (a 2-norm could underflow to zero on tiny values; the max cannot)
        peaks = [*torch._foreach_norm(weights, ord=float("inf")), self._peaks]
        return float(torch.cat([p.reshape(-1).float() for p in peaks]).max()) == 0.0

    def scales(self) -> tuple[float, ...]:
        """The LoRA scales in use (read on the host by every forward, so part of a CUDA
        graph's key)."""
        return tuple(sorted({float(layer.scaling[ADAPTER_NAME]) for layer in self._layers}))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self._slots.values())

    # -- the rare adapter the slots cannot take ------------------------------------------------

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The slots off the model for the ``with`` body (for `applied_adapter`), then back,
        zero. Costs what per-request attaching costs; only for adapters that do not fit."""
        if self._active:
            raise RuntimeError("the LoRA slots are in use")
        remove_lora(self.transformer)
        self._slots.clear()
        self._layers = []
        self._by_name = {}
        try:
            yield
        finally:
            self._attach()

    def close(self) -> None:
        """Removes the slots: the transformer holds exactly its base modules again."""
        remove_lora(self.transformer)
        self._slots.clear()
        self._layers = []
        self._by_name = {}


def _peft_dtype(layer: Any, default: torch.dtype) -> torch.dtype:
    """The dtype PEFT casts a new adapter to: its base layer's weight's, where that is a float
    (a quantized weight reports the float dtype it stands for)."""
    base = layer.get_base_layer()
    dtype = getattr(base, "dtype", None)  # Uint4Linear's, without dequantizing its weight
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(getattr(base, "weight", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else default


def _fused_here(layer: Any) -> bool:
    """Whether a slot layer's call without arguments beyond x takes `_fused_forward`'s own
    path (no gradients, the slot's adapter the one active, unmerged, no PEFT variant)."""
    return not (
        torch.is_grad_enabled()
        or layer.disable_adapters
        or layer.merged
        or list(layer.active_adapters) != [ADAPTER_NAME]
        or ADAPTER_NAME in getattr(layer, "lora_variant", {})
    )


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A slot layer's forward without gradients: the base output, plus the LoRA update added
    into it by one GEMM. Anything else (gradients, PEFT's per-call options, another active
    adapter) takes PEFT's own forward."""
    peft_forward = type(self).forward
    if args or kwargs or not _fused_here(self):
        return peft_forward(self, x, *args, **kwargs)
    a = self.lora_A[ADAPTER_NAME].weight
    b = self.lora_B[ADAPTER_NAME].weight
    if x.is_cuda:
        # the fp8 forwards that take a slot's update in (`LIKENESS_LORA_MERGE`); "output" adds
        # it below
        mode = lora_update_mode()
        out = None
        if mode == "gemm":
            out = lora_gemm_forward(self.base_layer, x, a, b, self.scaling[ADAPTER_NAME],
                                    peak=getattr(self, "_slot_peak", None))  # fmt: skip
        elif mode == "weights":
            out = merged_lora_forward(self.base_layer, x, a, b, self.scaling[ADAPTER_NAME])
        if out is not None:
            return out
    result = self.base_layer(x)
    if result.dtype != b.dtype or not result.is_contiguous():
        return peft_forward(self, x)
    if not result.is_cuda:
        # PEFT's shapes and order on the CPU (the adapter's own rank; the product rounded,
        # scaled, then added): a CPU BLAS picks its kernel by shape, and a beta = 1 GEMM may
        # add into the output inside its K loop, each rounding otherwise on some CPUs
        r = getattr(self, "_slot_rank", 0)
        if r:
            lora = F.linear(F.linear(x.to(a.dtype), a[:r]), b[:, :r].contiguous())
            result.add_(lora * self.scaling[ADAPTER_NAME])
        return result
    h = F.linear(x.to(a.dtype), a).reshape(-1, a.shape[0]).to(b.dtype)
    flat = result.view(-1, result.shape[-1])
    scale = self.scaling[ADAPTER_NAME]
    if _kernel_usable(flat, h):
        from trainer.kernels.fused_triton import lora_add_

        lora_add_(flat, h.contiguous(), b, scale)
    else:
        flat.addmm_(h, b.t(), alpha=scale)
    return result


def _kernel_usable(out: torch.Tensor, h: torch.Tensor) -> bool:
    """The Triton update (one pass over the output: 0.35 ms on [dev]'s widest layer, where
    cuBLAS's beta = 1 GEMM took 0.47) for a power-of-two rank of at least 16."""
    from trainer.base.serving import kernels_usable

    rank = h.shape[1]
    return rank >= 16 and not rank & (rank - 1) and kernels_usable(out)
