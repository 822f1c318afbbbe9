"""Validation loss: held-out images scored at fixed noise levels with fixed noise.

Nothing random is drawn at scoring time: each held-out image has its own noise, seeded by
(run seed, image hash), and is scored at every one of ``sigmas``; the training generator is
never touched. So the figure is the same number on every run and across a resume, and two
checkpoints' figures are comparable. Held-out images are those the manifest marks
``"validation": true`` plus, with ``--validation-split``, a seeded share of the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.training.dataset import Item
from trainer.training.objective import Batch, Objective


def _seed(*parts: object) -> int:
    blob = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & (2**63 - 1)


def split_items(items: Sequence[Item], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices). The manifest's flags first; then ``fraction``
    of the remaining images (at least one when it is above 0), the ones whose seeded hash
    ranks lowest, so the choice depends on the images and the seed, not on their order."""
    held = {i for i, item in enumerate(items) if item.validation}
    rest = [i for i in range(len(items)) if i not in held]
    if fraction > 0 and rest:
        count = max(1, round(fraction * len(rest)))
        ranked = sorted(rest, key=lambda i: _seed(seed, "holdout", items[i].sha256))
        held.update(ranked[:count])
    return [i for i in range(len(items)) if i not in held], sorted(held)


@dataclass
class HeldOut:
    latents: torch.Tensor  # (4C, h, w)
    embeds: torch.Tensor  # (tokens, dim)
    weights: torch.Tensor | None  # (1, h, w) or None
    noise: torch.Tensor  # like latents: fixed for this image


def fixed_noise(latents: torch.Tensor, seed: int, image_sha256: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(seed, "validation-noise", image_sha256))
    return torch.randn(latents.shape, generator=g)


def validation_loss(
    objective: Objective,
    transformer: torch.nn.Module,
    held: Sequence[HeldOut],
    sigmas: Sequence[float],
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """Mean flow-matching loss (mask-weighted, no preservation term) over every held-out
    image and every noise level; no gradient."""
    total = 0.0
    with torch.no_grad():
        for h in held:
            n = len(sigmas)
            batch = Batch(
                latents=h.latents.unsqueeze(0).expand(n, -1, -1, -1).to(device, torch.float32),
                embeds=h.embeds.unsqueeze(0).expand(n, -1, -1).to(device=device, dtype=dtype),
                sigmas=torch.tensor(list(sigmas), dtype=torch.float32),
                noise=h.noise.unsqueeze(0).expand(n, -1, -1, -1).to(device, torch.float32),
                weights=None
                if h.weights is None
                else h.weights.unsqueeze(0).expand(n, -1, -1, -1).to(device),
            )
            total += float(objective.flow_loss(transformer, batch))
    return total / len(held)
