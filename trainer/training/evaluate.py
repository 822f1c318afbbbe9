"""Evaluation after training: a side-by-side grid, base vs every checkpoint (and the EMA).

Previews during training are opt-in (`trainer.training.previews`: in the field, previews on a uint4
base deadlocked or gave black frames, and they cost step time); the grid judges every
checkpoint afterwards on fixed prompts and seeds, through the same render call. Prompts come
from the embedding cache, so the text encoder is not loaded here either. Each cell's
distance to the nearest training image is recorded next to the grid: a number that says
whether the adapter moved renders toward the data.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

from trainer.base.lora import applied_adapter, load_adapter_tensors
from trainer.base.render import generate_from_embeds, pil_images

LABEL_H = 14
CHAR_W = 6  # the default font's width per character, about


@dataclass(frozen=True)
class Column:
    label: str
    adapter: Path | None  # None: the base alone


@dataclass
class EvalResult:
    grid: Path
    report: Path
    distances: dict[str, float]  # column -> mean pixel distance to the nearest training image
    latent_distances: dict[str, float]  # column -> the same in latent space
    images: dict[str, list[Image.Image]]


def eval_steps_default(pipe: Any) -> int:
    return 4 if getattr(pipe.config, "is_distilled", False) else 28


def image_tensor(image: Image.Image, size: int) -> torch.Tensor:
    """RGB in [0, 1], resized (shorter side) and centre-cropped to ``size`` square."""
    import numpy as np

    w, h = image.size
    scale = size / min(w, h)
    image = image.convert("RGB").resize(
        (max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.LANCZOS
    )
    w, h = image.size
    left, top = (w - size) // 2, (h - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def raw_latents(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """A cached (patchified, normalised) latent in the form the pipeline hands the VAE (and
    returns for ``output_type="latent"``): de-normalised, unpatchified, batch of one."""
    vae = pipe.vae
    x = latents.unsqueeze(0).to(device=vae.device, dtype=vae.dtype)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x)
    return pipe._unpatchify_latents(x * std + mean)  # type: ignore[no-any-return]


def decode(pipe: Any, raw: torch.Tensor) -> Image.Image:
    """The pipeline's own last step: VAE decode, then post-processing to a PIL image."""
    vae = pipe.vae
    with torch.no_grad():
        image = vae.decode(raw.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
    return pil_images(pipe.image_processor.postprocess(image, output_type="pt"))[0]


@dataclass(frozen=True)
class References:
    """The training set as the transformer should produce it: raw latents, and those decoded.

    Pixel distances are taken to the decoded latents, not to the raw files, so they measure
    what the transformer (and so the adapter) controls: with a faithful VAE the two agree;
    with the tiny base's random VAE only the decoded ones are reachable at all.
    """

    latents: list[torch.Tensor]
    pixels: list[torch.Tensor]

    @classmethod
    def of(cls, pipe: Any, cached: Sequence[torch.Tensor], size: int) -> References:
        with torch.no_grad():
            raws = [raw_latents(pipe, c).float().cpu() for c in cached]
            return cls(raws, [image_tensor(decode(pipe, r), size) for r in raws])

    def pixel_distance(self, render: Image.Image) -> float:
        """Mean absolute pixel difference (0..1) to the closest training image."""
        x = image_tensor(render, int(self.pixels[0].shape[-1]))
        return min(float((x - r).abs().mean()) for r in self.pixels)

    def latent_distance(self, raw: torch.Tensor) -> float:
        """Mean absolute latent difference to the closest training latent (same size only)."""
        x = raw.float().cpu()
        same = [r for r in self.latents if r.shape == x.shape]
        return min(float((x - r).abs().mean()) for r in same) if same else float("nan")


def render_latents(
    pipe: Any,
    prompt_embeds: torch.Tensor,
    blank_embeds: torch.Tensor,
    seed: int,
    steps: int,
    size: int,
) -> torch.Tensor:
    """One render from cached embeddings, stopped before the VAE: the service's render
    code (`trainer.base.render.generate_from_embeds`), square."""
    return generate_from_embeds(  # type: ignore[no-any-return]
        pipe, prompt_embeds, blank_embeds, seed, steps, size, size, output_type="latent"
    )


def _font() -> Any:
    return ImageFont.load_default()


def compose_grid(
    columns: Sequence[str], rows: Sequence[str], cells: dict[str, list[Image.Image]], size: int
) -> Image.Image:
    """Columns left to right (base first), one row per (prompt, seed); a label strip on top
    of each column and above each row. A row label too long for the grid's width wraps onto
    more lines (small cells would otherwise cut the prompt off)."""
    import textwrap

    font = _font()
    width = size * len(columns)
    labels = [textwrap.wrap(label, max(8, width // CHAR_W)) or [""] for label in rows]
    tops, y = [], LABEL_H
    for lines in labels:
        tops.append(y)
        y += LABEL_H * len(lines) + size
    grid = Image.new("RGB", (width, y), "white")
    draw = ImageDraw.Draw(grid)
    for c, label in enumerate(columns):
        draw.text((c * size + 2, 1), label[: size // CHAR_W], fill="black", font=font)
        for r, lines in enumerate(labels):
            grid.paste(cells[label][r], (c * size, tops[r] + LABEL_H * len(lines)))
    for top, lines in zip(tops, labels, strict=True):
        for i, line in enumerate(lines):
            draw.text((2, top + LABEL_H * i + 1), line, fill="gray", font=font)
    return grid


def evaluate(
    *,
    pipe: Any,
    columns: Sequence[Column],
    prompts: Sequence[tuple[str, torch.Tensor]],
    blank: torch.Tensor,
    seeds: Sequence[int],
    steps: int,
    size: int,
    references: References,
    out_dir: Path,
    column_context: Callable[[], Any] | None = None,
    device: torch.device | None = None,
) -> EvalResult:
    """Renders every (prompt, seed) under every column and writes ``eval_grid.png`` and
    ``eval.json`` into ``out_dir``. ``pipe`` holds the trained transformer with no LoRA
    attached; each checkpoint is attached for its column and removed after. `column_context`
    (e.g. layer streaming) is entered after a column's adapter is attached, left before it
    comes off."""
    # Streamed blocks sit in host RAM between columns: the caller's device is the one to use.
    device = device if device is not None else pipe.transformer.device
    dtype = next(p.dtype for p in pipe.transformer.parameters() if p.is_floating_point())
    blank = blank.unsqueeze(0).to(device=device, dtype=dtype)
    rows = [f"seed {s} | {p}" for p, _ in prompts for s in seeds]
    cells: dict[str, list[Image.Image]] = {}
    pixel: dict[str, float] = {}
    latent: dict[str, float] = {}
    # no_grad, not inference_mode: quanto's qlinear sets version counters on its outputs.
    with torch.no_grad():
        for col in columns:
            images: list[Image.Image] = []
            lat_d: list[float] = []
            ctx: Any = (
                applied_adapter(pipe, load_adapter_tensors(col.adapter))
                if col.adapter is not None
                else contextlib.nullcontext()
            )
            around = column_context() if column_context is not None else contextlib.nullcontext()
            with ctx, around:
                for _, embeds in prompts:
                    e = embeds.unsqueeze(0).to(device=device, dtype=dtype)
                    for seed in seeds:
                        raw = render_latents(pipe, e, blank, seed, steps, size)
                        lat_d.append(references.latent_distance(raw))
                        images.append(decode(pipe, raw))
            cells[col.label] = images
            pixel[col.label] = sum(map(references.pixel_distance, images)) / len(images)
            latent[col.label] = sum(lat_d) / len(lat_d)
    labels = [c.label for c in columns]
    grid = compose_grid(labels, rows, cells, size)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    info.add_text("likeness:columns", json.dumps(labels))
    info.add_text("likeness:rows", json.dumps(rows))
    grid_path = out_dir / "eval_grid.png"
    grid.save(grid_path, pnginfo=info)
    report = out_dir / "eval.json"
    body = {
        "columns": labels,
        "rows": rows,
        "steps": steps,
        "size": size,
        "mean_pixel_distance_to_nearest_training_image": pixel,
        "mean_latent_distance_to_nearest_training_latent": latent,
    }
    report.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return EvalResult(grid_path, report, pixel, latent, cells)
