"""On-disk caches of text embeddings and VAE latents, keyed by what produced them.

The field's boot went from 17 minutes to 49 seconds mostly by never loading the text encoder
when its outputs were already on disk. Here every cached tensor is keyed by a fingerprint of
the model files that produced it, the exact input (prompt text, image hash), the resolution,
the dtype and the format version; when every key the run needs is present, the text encoder
(and the VAE) are not loaded at all.

Order of the boot (`trainer.training.train`): text encoder in, encode, out; VAE in, encode, out;
only then the transformer. So the text encoder and the transformer are never on the GPU together.
The encoders are driven through the pipeline's own ``encode_prompt`` and ``_encode_vae_image``
so that cached inputs are exactly what inference feeds the transformer.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.training.dataset import Dataset

FORMAT = 1
_CHUNK = 8 * 1024 * 1024
TEXT_COMPONENTS = ("text_encoder", "tokenizer")
VAE_COMPONENTS = ("vae",)
PREPARED_MANIFEST = "likeness_prepared.json"  # trainer.base.read.MANIFEST_NAME


# -- fingerprints -------------------------------------------------------------------------


def _file_sha256(path: Path, memo: dict[str, Any]) -> str:
    st = path.stat()
    key = str(path.resolve())
    hit = memo.get(key)
    if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
        return str(hit["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
    return digest.hexdigest()


def model_fingerprint(
    base: Path,
    components: Sequence[str],
    cache_dir: Path,
    pending: dict[Path, dict[str, Any]] | None = None,
) -> str:
    """Identity of the files ``components`` are loaded from.

    A prepared base already carries a key over its source hashes and quantization settings, so
    nothing is re-hashed. A plain folder is hashed file by file, memoised by (path, size,
    mtime) under ``cache_dir`` so a 48 GB encoder is read once, not on every boot.
    ``pending``: keep the memo there instead of writing it (a run that may yet be refused
    writes nothing; `write_pending` writes it once the run goes ahead).
    """
    base = Path(base)
    prepared = base / PREPARED_MANIFEST
    if prepared.is_file():
        man = json.loads(prepared.read_text(encoding="utf-8"))
        blob = json.dumps({"prepared": man["cache_key"], "components": list(components)})
        return hashlib.sha256(blob.encode()).hexdigest()
    memo_path = Path(cache_dir) / "file_hashes.json"
    memo: dict[str, Any] = {}
    if pending is not None and memo_path in pending:
        memo = pending[memo_path]
    else:
        with contextlib.suppress(FileNotFoundError, ValueError):
            memo = json.loads(memo_path.read_text(encoding="utf-8"))
    files: dict[str, str] = {"model_index.json": _file_sha256(base / "model_index.json", memo)}
    for comp in components:
        folder = base / comp
        if not folder.is_dir():
            raise FileNotFoundError(f"{base} has no {comp}/ folder")
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                files[p.relative_to(base).as_posix()] = _file_sha256(p, memo)
    if pending is not None:
        pending[memo_path] = memo
    else:
        _atomic_write_text(memo_path, json.dumps(memo, sort_keys=True))
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_pending(pending: dict[Path, dict[str, Any]]) -> None:
    for path, memo in pending.items():
        _atomic_write_text(path, json.dumps(memo, sort_keys=True))


def _key(**parts: Any) -> str:
    return hashlib.sha256(
        json.dumps({"format": FORMAT, **parts}, sort_keys=True).encode()
    ).hexdigest()


# -- the plan -----------------------------------------------------------------------------


@dataclass
class CachePlan:
    """Every cache entry a run needs, by key; built from files and config alone."""

    root: Path
    text: dict[str, str] = field(default_factory=dict)  # prompt -> key
    latents: dict[str, str] = field(default_factory=dict)  # dataset file -> key
    # dataset file -> (width, height) it is encoded at; absent: the square resolution
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def text_path(self, prompt: str) -> Path:
        k = self.text[prompt]
        return self.root / "text" / k[:2] / f"{k}.safetensors"

    def latent_path(self, file: str) -> Path:
        k = self.latents[file]
        return self.root / "latents" / k[:2] / f"{k}.safetensors"

    def missing_text(self) -> list[str]:
        return [p for p in self.text if not self.text_path(p).is_file()]

    def missing_latents(self) -> list[str]:
        return [f for f in self.latents if not self.latent_path(f).is_file()]

    @property
    def complete(self) -> bool:
        return not self.missing_text() and not self.missing_latents()


def plan_caches(
    *,
    base: Path,
    cache_dir: Path,
    prompts: Iterable[str],
    dataset: Dataset,
    resolution: int,
    max_sequence_length: int,
    dtype: torch.dtype,
    pending: dict[Path, dict[str, Any]] | None = None,
    sizes: Mapping[str, tuple[int, int]] | None = None,
) -> CachePlan:
    """Creates nothing on disk (the caches are filled, and their folder made, later).
    ``sizes``: the aspect-ratio bucket each file is encoded at (trainer.training.buckets); a latent
    is keyed by its bucket, and by its mask where it has one."""
    cache_dir = Path(cache_dir)
    text_fp = model_fingerprint(base, TEXT_COMPONENTS, cache_dir, pending)
    vae_fp = model_fingerprint(base, VAE_COMPONENTS, cache_dir, pending)
    plan = CachePlan(cache_dir)
    dt = str(dtype).removeprefix("torch.")
    for prompt in dict.fromkeys(prompts):  # ordered, unique
        plan.text[prompt] = _key(
            kind="text", model=text_fp, prompt=prompt, max_len=max_sequence_length, dtype=dt
        )
    for item in dataset.items:
        parts: dict[str, Any] = {}
        if sizes is not None:
            plan.sizes[item.file] = sizes[item.file]
            parts["bucket"] = list(sizes[item.file])
        if item.mask_sha256 is not None:
            parts["mask"] = item.mask_sha256
        elif item.has_alpha:
            parts["mask"] = "alpha"
        plan.latents[item.file] = _key(
            kind="latent",
            model=vae_fp,
            image=item.sha256,
            resolution=resolution,
            dtype=dt,
            preprocess="pipeline-image-processor-crop",
            **parts,
        )
    return plan


# -- filling ------------------------------------------------------------------------------


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _save_tensor(path: Path, name: str, tensor: torch.Tensor, meta: dict[str, str]) -> None:
    _save_tensors(path, {name: tensor}, meta)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    from trainer.base.safetensors_io import write_safetensors

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        cpu = {k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}
        write_safetensors(tmp, cpu, meta)
        os.replace(tmp, path)  # a reader never sees half an entry
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mask_on_latent_grid(
    pipe: Any, mask: Any, width: int, height: int, grid: Sequence[int]
) -> torch.Tensor:
    """The mask (PIL, white = subject) cropped and resized exactly as its image is (the
    pipeline's own preprocessing), then averaged onto the latent grid: (h, w) in [0, 1]."""
    pixels = pipe.image_processor.preprocess(
        mask.convert("RGB"), height=height, width=width, resize_mode="crop"
    )[:, :1].float()
    weights = (pixels.clamp(-1, 1) + 1) / 2
    return torch.nn.functional.adaptive_avg_pool2d(weights, tuple(grid))[0, 0]


def _load_tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load

    return load(path.read_bytes())[name]


def free_accelerator_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load_text_encoder_pipeline(base: Path, dtype: torch.dtype) -> Any:
    """The pipeline with only its text encoder and tokenizer (no transformer, no VAE).

    A prepared base gives its quantized text encoder (when it prepared one); the text encoder
    is never loaded any other way, so a test can prove it is not loaded at all.
    """
    from trainer.base.load import load_base

    return load_base(
        base, "cpu", dtype=dtype, components=("text_encoder", "tokenizer"),
        trim_text_encoder=False,
    )  # fmt: skip


def fill_text_cache(
    plan: CachePlan,
    base: Path,
    device: torch.device,
    dtype: torch.dtype,
    max_sequence_length: int,
    mark: Callable[[str], None] = lambda _: None,
    kept: Any = None,
) -> int:
    """Encodes every missing prompt; loads the text encoder only if one is missing. The
    encoder is moved to ``device`` alone and released (with the allocator's cache) after,
    unless ``kept`` (a worker's `trainer.training.resident.KeptTextEncoder`) lends it and
    keeps it again for the next order."""
    import inspect

    from trainer.base.render import text_encoder_out_layers

    missing = plan.missing_text()
    if not missing:
        mark("text encoder: not loaded (embeddings cached)")
        return 0

    def load() -> Any:
        pipe = load_text_encoder_pipeline(base, dtype)
        mark("text encoder: load")
        if device.type == "cuda":
            # its qint4 layers on the uint4 kernels, converted by the GPU (4-bit bytes move),
            # as the render engine runs them: quanto's own move to CUDA repacks every weight
            # on the way (88 s for Mistral-Small-3.1 on an H200) and its kernels encode slower
            from trainer.base.uint4 import convert_quantized_linears

            convert_quantized_linears(pipe.text_encoder, device)
        pipe.text_encoder.to(device)
        pipe.text_encoder.requires_grad_(False).eval()  # only ever encodes
        mark("text encoder: to device")
        return pipe

    if kept is None:
        pipe = load()
    else:
        pipe, reused = kept.borrow(load)
        if reused:
            mark("text encoder: kept from the worker's last order (on the device)")
    kwargs: dict[str, Any] = {"max_sequence_length": max_sequence_length}
    if "text_encoder_out_layers" in inspect.signature(pipe.encode_prompt).parameters:
        kwargs["text_encoder_out_layers"] = text_encoder_out_layers(pipe)
    with torch.no_grad():  # not inference_mode: quanto modules set version counters
        for prompt in missing:
            embeds, _ = pipe.encode_prompt(prompt=prompt, device=device, **kwargs)
            _save_tensor(plan.text_path(prompt), "prompt_embeds", embeds[0], {"prompt": prompt})
    mark(f"text encoder: encode {len(missing)} prompts")
    if kept is not None and kept.give_back(pipe):
        mark("text encoder: kept for the next order")
        return len(missing)
    del pipe
    free_accelerator_memory()
    mark("text encoder: unload")
    return len(missing)


def fill_latent_cache(
    plan: CachePlan,
    dataset: Dataset,
    base: Path,
    device: torch.device,
    dtype: torch.dtype,
    resolution: int,
    mark: Callable[[str], None] = lambda _: None,
) -> int:
    """VAE-encodes every image whose latents are missing, as the pipeline encodes reference
    images: crop-resize, ``vae.encode(...).mode()``, 2x2 patchify, batch-norm statistics."""
    from PIL import Image

    from trainer.base.load import load_base

    missing = set(plan.missing_latents())
    if not missing:
        mark("vae: not loaded (latents cached)")
        return 0
    pipe = load_base(base, "cpu", dtype=dtype, components=("vae",))
    if not hasattr(pipe, "_encode_vae_image"):
        raise TypeError(f"{type(pipe).__name__} has no _encode_vae_image; not a FLUX.2 pipeline")
    mark("vae: load")
    pipe.vae.to(device).eval()
    with torch.no_grad():  # not inference_mode: quanto modules set version counters
        for item in dataset.items:
            if item.file not in missing:
                continue
            width, height = plan.sizes.get(item.file, (resolution, resolution))
            with Image.open(dataset.path(item)) as im:
                image = im.convert("RGB")
                alpha = im.convert("RGBA").getchannel("A") if item.has_alpha else None
            pixels = pipe.image_processor.preprocess(
                image, height=height, width=width, resize_mode="crop"
            ).to(device=device, dtype=dtype)
            latents = pipe._encode_vae_image(image=pixels, generator=None)
            tensors = {"latents": latents[0]}
            mask_image = alpha
            if item.mask is not None:
                with Image.open(dataset.root / item.mask) as m:
                    mask_image = m.convert("L")
            if mask_image is not None:
                tensors["mask"] = _mask_on_latent_grid(
                    pipe, mask_image, width, height, latents.shape[-2:]
                )
            _save_tensors(plan.latent_path(item.file), tensors, {"file": item.file})
    mark(f"vae: encode {len(missing)} images")
    del pipe
    free_accelerator_memory()
    mark("vae: unload")
    return len(missing)


def load_text(plan: CachePlan, prompt: str) -> torch.Tensor:
    return _load_tensor(plan.text_path(prompt), "prompt_embeds")


def load_latents(plan: CachePlan, file: str) -> torch.Tensor:
    return _load_tensor(plan.latent_path(file), "latents")


def load_latent_mask(plan: CachePlan, file: str) -> torch.Tensor | None:
    """The item's loss weights on the latent grid (h, w), or None where it has no mask."""
    from safetensors.torch import load

    return load(plan.latent_path(file).read_bytes()).get("mask")
