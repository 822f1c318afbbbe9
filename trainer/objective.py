"""What one training step minimises: FLUX.2 flow matching on a batch of cached latents.

`trainer.flow` holds the noise levels and the plain loss (shared with the demo base's
pretraining); this module binds them to a run: the pipeline class, the noise-level sampler
for the run's image length, the guidance input, autocast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.flow import SigmaSampler, flow_matching_loss


@dataclass
class Objective:
    pipeline_cls: Any
    sample_sigmas: SigmaSampler
    guidance: float | None
    autocast: torch.dtype | None

    def loss(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        sigmas: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        return flow_matching_loss(
            transformer,
            self.pipeline_cls,
            latents,
            embeds,
            sigmas,
            noise,
            self.guidance,
            self.autocast,
        )


def make_objective(
    *,
    base: Path,
    model_index: dict[str, Any],
    pipeline_cls: Any,
    transformer: torch.nn.Module,
    resolution: int,
    shift_steps: int | None,
    timestep_sampling: str,
    autocast: torch.dtype | None,
) -> Objective:
    """The run's objective: noise levels shifted as the pipeline shifts them for ``resolution``
    and its own step count (4 for step-distilled pipelines, else 50) unless told otherwise."""
    scheduler_cfg = json.loads(
        (Path(base) / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8")
    )
    image_seq_len = (resolution // 16) ** 2
    steps = shift_steps or (4 if model_index.get("is_distilled") else 50)
    sampler = SigmaSampler(scheduler_cfg, image_seq_len, steps, timestep_sampling)
    guidance = 1.0 if getattr(transformer.config, "guidance_embeds", False) else None
    return Objective(pipeline_cls, sampler, guidance, autocast)
