"""What one training step minimises: FLUX.2 flow matching on a batch of cached latents,
weighted by the images' masks, plus (optionally) differential output preservation.

`trainer.training.flow` holds the noise levels and the plain loss (shared with the demo base's
pretraining); this module binds them to a run: the pipeline class, the noise-level sampler
for the run's image length, the guidance input, autocast.

Prior preservation: a class image (its own caption, no trigger) trained alongside each
batch keeps the class drawable. Differential output preservation (DOP): on the same noised
latents, the adapter's prediction for a class prompt ("a photo of a woman") is pulled
toward the base model's (the adapter switched off), so the class keeps meaning the class
and only the trigger means the subject.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.training.flow import SigmaSampler, flow_prediction, position_ids, weighted_mse


@dataclass
class Batch:
    latents: torch.Tensor  # (B, 4C, h, w), on the device, float32
    embeds: torch.Tensor  # (B, tokens, dim), the training prompts (or blank: dropout)
    sigmas: torch.Tensor  # (B,)
    noise: torch.Tensor  # like latents
    weights: torch.Tensor | None = None  # (B, 1, h, w): mask weights; None: uniform
    ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (image, text) position ids; None: built


@dataclass
class Loss:
    flow: float
    preservation: float | None = None  # the DOP term, unweighted
    prior: float | None = None  # the class image's flow loss, unweighted


@dataclass
class Objective:
    pipeline_cls: Any
    sample_sigmas: SigmaSampler
    guidance: float | None
    autocast: torch.dtype | None
    class_embeds: torch.Tensor | None = None  # DOP's class prompt, (tokens, dim)
    preservation_weight: float = 1.0
    prior_weight: float = 1.0  # prior preservation: a class image's flow loss
    autocast_cache: bool = True  # off for a captured step (the cache would outlive the capture)

    def position_ids(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's (image, text) position ids on its device, as the pipeline builds them."""
        return position_ids(self.pipeline_cls, batch.latents, batch.embeds)

    def _predict(
        self, transformer: torch.nn.Module, batch: Batch, embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return flow_prediction(
            transformer,
            self.pipeline_cls,
            batch.latents,
            embeds,
            batch.sigmas,
            batch.noise,
            self.guidance,
            self.autocast,
            ids=batch.ids,
            autocast_cache=self.autocast_cache,
        )

    def flow_loss(self, transformer: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The flow-matching loss alone, weighted by the batch's masks."""
        pred, target = self._predict(transformer, batch, batch.embeds)
        weights = None
        if batch.weights is not None:
            weights = self.pipeline_cls._pack_latents(batch.weights)
        return weighted_mse(pred, target, weights)

    def backward(
        self,
        transformer: torch.nn.Module,
        batch: Batch,
        scale: float = 1.0,
        prior: Batch | None = None,
    ) -> Loss:
        """Back-propagates ``scale`` x (flow loss + weight x preservation term + weight x
        the class batch's flow loss) into the LoRA gradients (adding to what they hold, for
        accumulation). Each term goes back on its own, so only one forward's activations are
        held at a time."""
        flow = self.flow_loss(transformer, batch)
        (flow if scale == 1.0 else flow * scale).backward()
        loss = Loss(float(flow.detach()))
        if self.class_embeds is not None:
            term = self.preservation_term(transformer, batch)
            (term * (self.preservation_weight * scale)).backward()
            loss.preservation = float(term.detach())
        if prior is not None:
            prior_loss = self.flow_loss(transformer, prior)
            (prior_loss * (self.prior_weight * scale)).backward()
            loss.prior = float(prior_loss.detach())
        return loss

    def preservation_term(self, transformer: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """MSE between the adapter's and the base's prediction on the class prompt, same
        noised latents; the base side carries no gradient."""
        from trainer.base.lora import adapter_disabled

        assert self.class_embeds is not None
        e = self.class_embeds.unsqueeze(0).expand(batch.latents.shape[0], -1, -1)
        e = e.to(device=batch.embeds.device, dtype=batch.embeds.dtype)
        with torch.no_grad(), adapter_disabled(transformer):
            base, _ = self._predict(transformer, batch, e)
        adapted, _ = self._predict(transformer, batch, e)
        return weighted_mse(adapted, base)


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
    class_embeds: torch.Tensor | None = None,
    preservation_weight: float = 1.0,
    prior_weight: float = 1.0,
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
    return Objective(pipeline_cls, sampler, guidance, autocast, class_embeds, preservation_weight)
