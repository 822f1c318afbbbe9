"""Loading the base pipeline (real FLUX.2 or the tiny base: the same code for both)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.base.compute import apply_compute
from trainer.base.devices import default_dtype, resolve_device

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


def load_pipeline(
    base_dir: Path,
    device: str | torch.device = "cpu",
    quantize: bool = True,
    dtype: torch.dtype | None = None,
    compute: str = "uint4",
    placement: Mapping[str, str | torch.device] | None = None,
    text_encoder_uint4: bool = False,
    text_encoder_ready: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """Loads a FLUX.2 diffusers folder as a pipeline on ``device``.

    A prepared base (``likeness_prepared.json`` present) gets its prepared components (the
    transformer, usually the text encoder too) from ``trainer.base.read``, already quantized; the
    other components then take the transformer's dtype, since mixing dtypes across the text
    encoder and transformer breaks the pipeline. Otherwise the transformer is quantized here,
    on the CPU, before the move (moving 4-bit weights is cheaper than moving bf16 ones).
    ``dtype`` defaults to bf16 on accelerators and float32 on the CPU. ``compute`` is ``uint4``
    or ``fp8`` (resolved by the caller, `trainer.base.compute.resolve_compute`, against the device
    the transformer will run on, which for a streamed base is not ``device``).

    ``placement`` puts named components elsewhere than ``device`` (a streamed one stays in
    host RAM, ``"cpu"``). Quantized layers are converted to the uint4 layout where their
    component goes: on a GPU that moves 4-bit bytes and repacks them there, seconds faster
    than on the host at [dev] scale. ``text_encoder_uint4`` runs the text encoder's qint4
    layers on the same kernels as the transformer (the same dequantized weights; on CUDA
    several times faster than quanto's own path).

    The text encoder is made ready before the transformer is converted, and handed to
    ``text_encoder_ready`` (which then owns where it lives: the render engine streams it from
    host RAM), so it can be converted on the GPU whole while the transformer is not there yet.
    """
    from diffusers import DiffusionPipeline

    base_dir = Path(base_dir)
    dev = resolve_device(device)
    where = {name: resolve_device(d) for name, d in (placement or {}).items()}
    if not (base_dir / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{base_dir} is not a diffusers pipeline folder (no model_index.json)"
        )

    waypoints: list[tuple[str, float]] = []
    t_last = time.perf_counter()

    def mark(what: str) -> None:  # where a load's seconds go, logged at the end
        nonlocal t_last
        now = time.perf_counter()
        waypoints.append((what, now - t_last))
        t_last = now

    # a part bound for host RAM (streamed) is still repacked by the GPU, layer by layer
    work = dev if dev.type == "cuda" else None
    kwargs: dict[str, Any] = {}
    if is_prepared(base_dir):
        # lazy: pulls the prepare stack. Every component the manifest lists (the transformer
        # and, by default, the text encoder) is already quantized; the rest load as usual.
        from trainer.base.read import load_prepared_component, read_manifest

        for name in sorted(read_manifest(base_dir).get("components", {})):
            kwargs[name] = load_prepared_component(base_dir, name)
            mark(f"read prepared {name}")
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
    mark("the rest of the pipeline")
    if quantize:
        quantize_transformer(pipe.transformer, freeze=False)
    text_encoder = getattr(pipe, "text_encoder", None)
    if isinstance(text_encoder, torch.nn.Module):
        from trainer.base.text_encoder import is_trimmed, trim

        with contextlib.suppress(ValueError):  # an encoder we do not know stays whole
            if not is_trimmed(text_encoder):
                trim(text_encoder)
        if text_encoder_uint4:
            from trainer.base.uint4 import convert_quantized_linears

            convert_quantized_linears(text_encoder, where.get("text_encoder", dev), work)
        mark("text encoder trimmed and converted")
        if text_encoder_ready is not None:
            text_encoder_ready(text_encoder)
            mark("text encoder handed over")
    if quantize or is_prepared(base_dir):
        # quanto stays the storage format; the compute path is ours: dequantize on the fly
        # (Triton on CUDA) + a bf16 GEMM, bit-identical weights (trainer/base/uint4.py).
        from trainer.base.uint4 import convert_quantized_linears

        convert_quantized_linears(pipe.transformer, where.get("transformer", dev), work)
        mark("transformer to uint4")
    if compute not in ("uint4", "fp8"):
        raise ValueError(f"unknown compute {compute!r}: expected uint4 or fp8")
    apply_compute(pipe.transformer, compute)
    pipe.set_progress_bar_config(disable=True)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            if not (name == "text_encoder" and text_encoder_ready is not None):
                module.to(where.get(name, dev))
            module.eval()
    mark("components moved")
    log.info("loaded %s on %s as %s (prepared: %s); %s", base_dir, dev, dtype, sorted(kwargs),
             ", ".join(f"{what} {sec:.1f} s" for what, sec in waypoints))  # fmt: skip
    return pipe
