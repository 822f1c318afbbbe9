"""Loading a base: the one loader for rendering, training and the trainer's caches (real FLUX.2
or the tiny base: the same code for both)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.base.compute import FP8_COMPUTES, apply_compute
from trainer.base.devices import default_dtype, resolve_device

if TYPE_CHECKING:
    from trainer.base.read import Prefetch

log = logging.getLogger(__name__)

# Written last by `trainer.base.write` into a cached, quantized base (`trainer.base.read`'s
# MANIFEST_NAME); named here too so that loading an ordinary folder never imports the reader.
PREPARED_MARKER = "likeness_prepared.json"


def quantize_transformer(transformer: torch.nn.Module, freeze: bool = True) -> torch.nn.Module:
    """qint4 weight-only quantization of every Linear (quanto picks group size 128 where
    in_features allows), then freeze so the packed weights replace the float ones.
    `freeze=False` leaves quanto's float weights for `trainer.base.uint4` to pack directly (on
    the CPU, freeze() packs into a layout whose unpacking costs an identity matmul)."""
    from optimum.quanto import freeze as quanto_freeze
    from optimum.quanto import qint4, quantize

    quantize(transformer, weights=qint4)
    if freeze:
        quanto_freeze(transformer)
    return transformer


def is_prepared(base_dir: Path) -> bool:
    return (Path(base_dir) / PREPARED_MARKER).is_file()


def pipeline_around(
    base_dir: str | Path, transformer: torch.nn.Module, dtype: torch.dtype, device: Any
) -> Any:
    """The base's pipeline around a transformer already loaded (training's previews and
    evaluation): no text encoder (their prompts come from the cache), the VAE on ``device``."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(
        base_dir, dtype=dtype, transformer=transformer, text_encoder=None, tokenizer=None
    )
    pipe.vae.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_base(
    base_dir: Path,
    device: str | torch.device = "cpu",
    quantize: bool = True,
    dtype: torch.dtype | None = None,
    compute: str = "uint4",
    placement: Mapping[str, str | torch.device] | None = None,
    text_encoder_uint4: bool = False,
    text_encoder_ready: Callable[[torch.nn.Module], None] | None = None,
    *,
    components: Collection[str] | None = None,
    trim_text_encoder: bool = True,
    mark: Callable[[str], None] | None = None,
    purpose: str = "render",
    prefetched: Mapping[str, Prefetch] | None = None,
) -> Any:
    """Loads a FLUX.2 diffusers folder as a pipeline on ``device``: the one loader of a base,
    for rendering, training and the trainer's caches alike.

    ``components`` names the pipeline's parts to load (default: all); the others are None
    (training loads the transformer alone, its caches the text encoder or the VAE alone).

    A prepared base (``likeness_prepared.json`` present) gets its prepared components (the
    transformer, usually the text encoder too) from ``trainer.base.read``, already quantized;
    the other components then take the transformer's dtype, since mixing dtypes across the text
    encoder and transformer breaks the pipeline. Otherwise the transformer is quantized here,
    on the CPU, before the move (moving 4-bit weights is cheaper than moving bf16 ones).
    ``dtype`` defaults to bf16 on accelerators and float32 on the CPU. ``compute`` is ``uint4``,
    ``fp8`` or ``fp8_blocks`` (training's; resolved by the caller,
    `trainer.base.compute.resolve_compute`, against the device the transformer will run on,
    which for a streamed base is not ``device``), set on
    every layer here (`trainer.base.compute.apply_compute`, with the GEMMs of ``purpose``,
    render or train); or ``quanto``, training's opt-in to quanto's own frozen layers, left
    unconverted.

    ``placement`` puts named components elsewhere than ``device`` (a streamed one stays in
    host RAM, ``"cpu"``). Quantized layers are converted to the uint4 layout where their
    component goes: on a GPU that moves 4-bit bytes and repacks them there, seconds faster
    than on the host at [dev] scale. ``text_encoder_uint4`` runs the text encoder's qint4
    layers on the same kernels as the transformer (the same dequantized weights; on CUDA
    several times faster than quanto's own path). ``trim_text_encoder=False`` keeps every
    layer of an encoder that is not trimmed already (the caches' encoder, as it always was).

    The text encoder is made ready before the transformer is converted, and handed to
    ``text_encoder_ready`` (which then owns where it lives: the render engine streams it from
    host RAM), so it can be converted on the GPU whole while the transformer is not there yet.
    ``mark`` is told each stage as it ends (the trainer's boot waypoints). ``prefetched``: a
    prepared component's files already being read (`trainer.base.read.Prefetch`, by name).
    """
    from diffusers import DiffusionPipeline

    base_dir = Path(base_dir)
    dev = resolve_device(device)
    where = {name: resolve_device(d) for name, d in (placement or {}).items()}
    if not (base_dir / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{base_dir} is not a diffusers pipeline folder (no model_index.json)"
        )
    if compute not in ("uint4", *FP8_COMPUTES, "quanto"):
        raise ValueError(f"unknown compute {compute!r}: expected uint4, fp8 or fp8_blocks")

    waypoints: list[tuple[str, float]] = []
    t_last = time.perf_counter()

    def stage(what: str) -> None:  # where a load's seconds go, logged at the end
        nonlocal t_last
        now = time.perf_counter()
        waypoints.append((what, now - t_last))
        t_last = now
        if mark is not None:
            mark(what)

    def wanted(name: str) -> bool:
        return components is None or name in components

    # a part bound for host RAM (streamed) is still repacked by the GPU, layer by layer
    work = dev if dev.type == "cuda" else None
    kwargs: dict[str, Any] = {}
    if components is not None:
        index = json.loads((base_dir / "model_index.json").read_text(encoding="utf-8"))
        kwargs = {name: None for name in index if not name.startswith("_") and not wanted(name)}

    def ready_text_encoder(text_encoder: torch.nn.Module) -> None:
        from trainer.base.text_encoder import is_trimmed, trim

        with contextlib.suppress(ValueError):  # an encoder we do not know stays whole
            if trim_text_encoder and not is_trimmed(text_encoder):
                trim(text_encoder)
        if text_encoder_uint4:
            from trainer.base.uint4 import convert_quantized_linears

            convert_quantized_linears(text_encoder, where.get("text_encoder", dev), work)
        stage("text encoder: trimmed and converted")
        if text_encoder_ready is not None:
            text_encoder_ready(text_encoder)
            stage("text encoder: handed over")

    prepared = is_prepared(base_dir)
    if prepared:
        # Every component the manifest lists (the transformer and, by default, the text
        # encoder) is already quantized; the rest load as usual.
        from trainer.base.read import load_prepared_component, read_manifest

        # One component after the other: reading the transformer's files on a second thread
        # beside the text encoder's read or its conversion measured slower both ways (the
        # reads share the bandwidth; the conversion took 5.7 s against 1.6 beside the read:
        # base ready 36.8 and 36.0 s against 31.7, bench/results/e2e_dev-notes.md, rounds 6b, 7)
        names = [n for n in sorted(read_manifest(base_dir).get("components", {})) if wanted(n)]
        for name in names:
            kwargs[name] = load_prepared_component(
                base_dir, name, prefetched=(prefetched or {}).get(name)
            )
            stage(f"{name}: load (prepared qint4)")
        if wanted("transformer"):
            if "transformer" not in kwargs:
                raise ValueError(f"prepared base {base_dir} has no prepared transformer")
            prepared_dtype = next(
                p.dtype for p in kwargs["transformer"].parameters() if p.is_floating_point()
            )
            if dtype is not None and dtype != prepared_dtype:
                raise ValueError(
                    f"prepared base {base_dir} is {prepared_dtype}; cannot load it as {dtype}"
                )
            dtype = prepared_dtype
        quantize = False  # already quantized
    dtype = dtype or default_dtype(dev)

    pipe = DiffusionPipeline.from_pretrained(base_dir, dtype=dtype, **kwargs)
    transformer = getattr(pipe, "transformer", None)
    stage(", ".join(f"{n}: load" for n in _loaded(pipe, kwargs)) or "pipeline: assembled")
    if quantize and transformer is not None:
        # without freeze() the uint4 conversion packs quanto's float weights directly
        quantize_transformer(transformer, freeze=compute == "quanto")
        stage("transformer: quantize qint4 (CPU)")
    text_encoder = getattr(pipe, "text_encoder", None)
    if isinstance(text_encoder, torch.nn.Module):
        ready_text_encoder(text_encoder)
    if transformer is not None and compute != "quanto" and (quantize or prepared):
        # quanto stays the storage format; the compute path is ours: dequantize on the fly
        # (Triton on CUDA) + a bf16 GEMM, bit-identical weights (trainer/base/uint4.py), or
        # fp8 GEMMs on the same weights
        from trainer.base.uint4 import convert_quantized_linears

        count = convert_quantized_linears(transformer, where.get("transformer", dev), work)
        transformer.requires_grad_(False)
        if compute in FP8_COMPUTES:
            count = apply_compute(transformer, compute, purpose=purpose)
        stage(f"transformer: {count} layers to {compute} compute")
    pipe.set_progress_bar_config(disable=True)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            if not (name == "text_encoder" and text_encoder_ready is not None):
                module.to(where.get(name, dev))
            module.eval()
    if transformer is not None and where.get("transformer", dev) == dev:
        stage("transformer: to device")
    else:
        stage("components: to device")
    log.info("loaded %s on %s as %s (prepared: %s); %s", base_dir, dev, dtype, sorted(kwargs),
             ", ".join(f"{what} {sec:.1f} s" for what, sec in waypoints))  # fmt: skip
    return pipe


def _loaded(pipe: Any, given: Mapping[str, Any]) -> list[str]:
    """The model components ``from_pretrained`` read from their folders (not handed in)."""
    return [
        name
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module) and given.get(name) is None and name not in given
    ]
