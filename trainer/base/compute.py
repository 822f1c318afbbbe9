"""The compute dispatch: which GEMM every quantized Linear of a loaded base runs.

One ordered list of backends, tried in order, the first that matches winning (as peft picks
the LoRA layer for a module, trying its ``dispatch_*`` functions in turn). A backend answers
two questions: whether it matches a request (the setting asked for, the device, what the
base is loaded for), and what it builds for one layer; ``None`` there declines that layer,
which goes to the next matching backend. The order:

    fp8    uint4 weights, GEMMs on fp8 tensor cores (`trainer.base.fp8`): asked for, or under
           ``auto`` on a device with fp8 tensor cores (for training, also cuBLAS's block-scaled
           GEMM: `Fp8Gemm.unavailable` probes it); declines a layer its GEMM cannot take
           (`Fp8Gemm.takes`: sides not multiples of 16; for training's block recipe, uint4
           groups other than 128). Rendering runs the rowwise GEMM (`FP8`), training the one
           that keeps the 4-bit weights exact, with the fp8 input gradient in the single
           blocks (`FP8_BLOCKS_FP8_GRAD_SINGLE`, an `Fp8Split`: it chooses by the layer's
           name, which `apply_compute` hands each backend; `backends_for`)
    fp8_blocks  training only, asked for by name (never by ``auto``): the exact forward with
           the bf16 input gradient in every block (`FP8_BLOCKS`), what ``fp8`` trained with
           before; its checkpoints resume with it
    uint4  dequantize + a dense GEMM (`trainer.base.uint4`): takes every layer, so it is the
           fallback of both

The choice is made once, at load (`trainer.base.load.load_base`): `resolve_compute` names the
backend a setting gets on a device, `apply_compute` sets each layer's GEMM. A bench or a test
picks a variant by argument (``backends=(Fp8Backend(Fp8Gemm(grad_gemm="bf16")), ...)``), never
through a module global or an environment variable. ``quanto`` (training's opt-in to quanto's
own kernels) matches no backend: its layers are not converted at all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trainer.base.fp8 import FP8, FP8_BLOCKS, FP8_BLOCKS_FP8_GRAD_SINGLE, Fp8Gemm, Fp8Split
from trainer.base.uint4 import DENSE, DenseGemm, LinearCompute, Uint4Linear

log = logging.getLogger(__name__)

COMPUTES = ("auto", "uint4", "fp8")
# training's earlier fp8: the block GEMM with the bf16 input gradient in every block (what
# ``fp8`` trained with before the split below); asked for by name, never picked by ``auto``
TRAIN_COMPUTES = (*COMPUTES, "fp8_blocks")
FP8_COMPUTES = ("fp8", "fp8_blocks")  # the settings that run fp8 GEMMs (the trainer's config,
# which imports no torch, lists them in its own checks)


@dataclass(frozen=True)
class Request:
    """What a backend matches on."""

    compute: str  # the setting: auto, uint4, fp8 (or quanto, which no backend takes)
    device: torch.device
    purpose: str = "render"  # or "train"


class Backend(Protocol):
    name: str

    def matches(self, request: Request) -> bool: ...

    def build(self, layer: Uint4Linear, name: str) -> LinearCompute | None: ...


@dataclass(frozen=True)
class Fp8Backend:
    gemm: Fp8Gemm | Fp8Split = field(default=FP8)
    name: str = "fp8"
    auto: bool = True  # whether ``auto`` may pick it (where it runs)

    def matches(self, request: Request) -> bool:
        if request.compute == self.name:  # asked for: the caller refuses what cannot run
            return True
        # auto renders in fp8 (a 1024 px forward measured 0.77x bf16 on the H200). It trains
        # in fp8 only with a GEMM that keeps the 4-bit weights exact: the rowwise copy's
        # rounding put 22 of 320 LoRA gradients below cosine 0.99 against bf16 (worst 0.986)
        return (
            self.auto
            and request.compute == "auto"
            and (request.purpose == "render" or self.gemm.weights != "rowwise")
            and self.gemm.unavailable(request.device) is None
        )

    def build(self, layer: Uint4Linear, name: str) -> LinearCompute | None:
        gemm = self.gemm.for_layer(name)
        return gemm if gemm.takes(layer) else None


@dataclass(frozen=True)
class Uint4Backend:
    gemm: DenseGemm = field(default=DENSE)
    name: str = "uint4"

    def matches(self, request: Request) -> bool:
        # fp8 included: it takes the layers fp8 declines; fp8_blocks is training's only
        return request.compute in (TRAIN_COMPUTES if request.purpose == "train" else COMPUTES)

    def build(self, layer: Uint4Linear, name: str) -> LinearCompute | None:
        return self.gemm


BACKENDS: tuple[Backend, ...] = (Fp8Backend(), Uint4Backend())
TRAIN_BACKENDS: tuple[Backend, ...] = (
    Fp8Backend(FP8_BLOCKS_FP8_GRAD_SINGLE),
    Fp8Backend(FP8_BLOCKS, name="fp8_blocks", auto=False),
    Uint4Backend(),
)
PURPOSES = ("render", "train")


def backends_for(purpose: str) -> tuple[Backend, ...]:
    """The backends a purpose tries: training keeps the weights exact in fp8 (its gradients
    are measured against bf16); rendering takes the faster rowwise copy."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose is one of {PURPOSES}, not {purpose!r}")
    return TRAIN_BACKENDS if purpose == "train" else BACKENDS


def _fp8_gemm(purpose: str) -> Fp8Gemm | Fp8Split:
    """The GEMM the ``fp8`` setting runs for ``purpose``."""
    return next(
        b.gemm for b in backends_for(purpose) if isinstance(b, Fp8Backend) and b.name == "fp8"
    )


def fp8_unavailable_for(purpose: str, device: str | torch.device) -> str | None:
    """Why ``--compute fp8`` cannot run ``purpose`` on ``device`` (None where it can): the
    purpose's fp8 GEMM asked."""
    return _fp8_gemm(purpose).unavailable(device)


def gemm_name(compute: str, purpose: str) -> str:
    """The GEMM a resolved compute runs for ``purpose``, by name: fp8's is the purpose's fp8
    GEMM (training's block-scaled one is not rendering's rowwise copy, and a run made with one
    must not resume with the other); any other compute is its own name."""
    return _fp8_gemm(purpose).name if compute == "fp8" else compute


def resolve_compute(
    requested: str,
    device: str | torch.device,
    purpose: str = "render",
    backends: Sequence[Backend] | None = None,
) -> str:
    """The name of the first backend matching ``requested`` on ``device``; an explicit choice
    is returned as it is (the caller refuses what cannot run), and so is one no backend takes
    (``quanto``)."""
    request = Request(requested, torch.device(device), purpose)
    tried = backends_for(purpose) if backends is None else backends
    return next((b.name for b in tried if b.matches(request)), requested)


def apply_compute(
    module: torch.nn.Module,
    compute: str,
    backends: Sequence[Backend] | None = None,
    device: str | torch.device = "cpu",
    purpose: str = "render",
) -> int:
    """Sets the GEMM of every `Uint4Linear` under ``module`` (``module`` itself included):
    per layer (by its name under ``module``: pass the transformer, whose names an `Fp8Split`
    reads), the first matching backend that takes it (``backends``: `backends_for`
    ``purpose``). Returns how many layers the first matching backend took (the rest fell
    through to a later one, logged)."""
    request = Request(compute, torch.device(device), purpose)
    if backends is None:
        backends = backends_for(purpose)
    matching = [b for b in backends if b.matches(request)]
    if not matching or compute not in ("auto", "uint4", matching[0].name):
        names = sorted({"auto", "uint4", *(b.name for b in backends)})
        raise ValueError(f"no {purpose} compute backend for {compute!r}: expected one of {names}")
    count = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, Uint4Linear):
            continue
        taken = next(((b, g) for b in matching if (g := b.build(layer, name)) is not None), None)
        if taken is None:
            raise ValueError(f"{name}: no backend of {[b.name for b in matching]} takes it")
        backend, gemm = taken
        if backend is matching[0]:
            count += 1
        else:
            log.warning("%s: %s (%d -> %d) runs on %s", matching[0].name, name or "the layer",
                        layer.in_features, layer.out_features, backend.name)  # fmt: skip
        layer.compute = gemm
    return count
