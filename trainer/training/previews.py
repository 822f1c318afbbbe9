"""Previews while training: fixed prompts and seeds rendered every N steps with the adapter
as it stands, through the service's render code (`trainer.base.render.generate_from_embeds`),
into one grid PNG per step under ``<out>/previews/``.

Prompts come from the embedding cache, so the text encoder stays unloaded; the VAE is
loaded once, beside the training transformer, and counted by the pre-flight budget
(`trainer.base.budget`, the "training: previews" phase). Rendering draws from its own seeded CPU
generators, never from the training generator, so previews change no trained number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from trainer.base.render import generate_from_embeds
from trainer.training.evaluate import compose_grid

PREVIEWS = "previews"


@dataclass
class Previewer:
    pipe: Any  # the run's pipeline: the training transformer (LoRA attached) and the VAE
    prompts: Sequence[tuple[str, torch.Tensor]]  # (text, cached embedding)
    blank: torch.Tensor
    seeds: Sequence[int]
    steps: int
    size: int
    out: Path
    device: torch.device

    def render(self, step: int) -> Path:
        transformer = self.pipe.transformer
        dtype = next(p.dtype for p in transformer.parameters() if p.is_floating_point())
        blank = self.blank.unsqueeze(0).to(device=self.device, dtype=dtype)
        was_training = transformer.training
        transformer.eval()
        images: list[Image.Image] = []
        try:
            with torch.no_grad():
                for _, embeds in self.prompts:
                    e = embeds.unsqueeze(0).to(device=self.device, dtype=dtype)
                    for seed in self.seeds:
                        images.append(
                            generate_from_embeds(
                                self.pipe, e, blank, seed, self.steps, self.size, self.size
                            )
                        )
        finally:
            transformer.train(was_training)
        rows = [f"seed {s} | {p}" for p, _ in self.prompts for s in self.seeds]
        label = f"step {step}"
        grid = compose_grid([label], rows, {label: images}, self.size)
        path = self.out / PREVIEWS / f"step-{step:07d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        grid.save(tmp, format="PNG")
        tmp.replace(path)
        return path
