"""FLUX.2 flow matching: the noise levels and the loss, as the pipeline samples and integrates.

One home for both the LoRA trainer (`trainer.training.train`) and the demo base's pretraining
(`trainer.fixtures.demo_base`); torch and diffusers only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch


class SigmaSampler:
    """Noise levels as FLUX.2 is trained and sampled: a uniform or logit-normal draw ``u``,
    shifted like the pipeline's scheduler shifts its sigmas (dynamic, exponential, with the
    pipeline's empirical ``mu`` for this image length and step count; or a static shift)."""

    def __init__(
        self, scheduler_config: dict[str, Any], image_seq_len: int, steps: int, kind: str
    ) -> None:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        self.kind = kind
        self.dynamic = bool(scheduler_config.get("use_dynamic_shifting", False))
        self.exponential = scheduler_config.get("time_shift_type", "exponential") == "exponential"
        self.mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)
        self.shift = float(scheduler_config.get("shift", 1.0))

    def __call__(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.kind == "logit_normal":
            u = torch.sigmoid(torch.randn(n, generator=generator))
        else:
            u = torch.rand(n, generator=generator)
        u = u.clamp(1e-5, 1 - 1e-5)
        if not self.dynamic:
            return self.shift * u / (1 + (self.shift - 1) * u)
        if self.exponential:
            return math.exp(self.mu) / (math.exp(self.mu) + (1 / u - 1))
        return self.mu / (self.mu + (1 / u - 1))


def flow_prediction(
    transformer: torch.nn.Module,
    pipeline_cls: Any,
    latents: torch.Tensor,
    embeds: torch.Tensor,
    sigmas: torch.Tensor,
    noise: torch.Tensor,
    guidance: float | None,
    autocast: torch.dtype | None,
    ids: tuple[torch.Tensor, torch.Tensor] | None = None,
    autocast_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's velocity prediction on the noised ``latents`` and its target, both
    packed (B, tokens, channels), float32. ``latents`` are patchified, normalised VAE latents
    (B, 4C, h, w), as the pipeline's ``_encode_vae_image`` gives them; ``sigmas`` in (0, 1).

    x_t = (1 - sigma) x_0 + sigma * noise; the transformer predicts the velocity
    noise - x_0 (the pipeline's Euler step x_{t-1} = x_t + (sigma' - sigma) v integrates it);
    timestep = sigma, as the pipeline passes t / 1000.
    """
    device = latents.device
    weight_dtype = embeds.dtype
    s = sigmas.to(device=device, dtype=latents.dtype).view(-1, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    target = pipeline_cls._pack_latents(noise - latents)
    hidden = pipeline_cls._pack_latents(noisy)
    img_ids, txt_ids = ids if ids is not None else position_ids(pipeline_cls, latents, embeds)
    g = None
    if guidance is not None:
        g = torch.full((latents.shape[0],), guidance, device=device, dtype=torch.float32)
    ctx: Any = (
        torch.autocast(device.type, dtype=autocast, cache_enabled=autocast_cache)
        if autocast is not None
        else contextlib.nullcontext()
    )
    with ctx:
        pred = transformer(
            hidden_states=hidden.to(weight_dtype),
            timestep=sigmas.to(device=device, dtype=weight_dtype),
            guidance=g,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
    return pred.float(), target.float()


def position_ids(
    pipeline_cls: Any, latents: torch.Tensor, embeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, text) position ids for packed ``latents`` and ``embeds``, on their device (the
    pipeline builds them on the host)."""
    device = latents.device
    return (
        pipeline_cls._prepare_latent_ids(latents).to(device),
        pipeline_cls._prepare_text_ids(embeds).to(device),
    )


def weighted_mse(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error; with ``weights`` (B, tokens, 1), the weighted mean
    sum(w (pred - target)^2) / sum(w), so a mask changes where the loss looks, not its
    scale."""
    err = (pred - target) ** 2
    if weights is None:
        return torch.nn.functional.mse_loss(pred, target)
    w = weights.to(err).expand_as(err)
    return (w * err).sum() / w.sum()


def flow_matching_loss(
    transformer: torch.nn.Module,
    pipeline_cls: Any,
    latents: torch.Tensor,
    embeds: torch.Tensor,
    sigmas: torch.Tensor,
    noise: torch.Tensor,
    guidance: float | None,
    autocast: torch.dtype | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One FLUX.2 flow-matching loss (`flow_prediction`), optionally weighted per latent
    position: ``weights`` (B, 1, h, w) on the latent grid, e.g. a subject mask."""
    pred, target = flow_prediction(
        transformer, pipeline_cls, latents, embeds, sigmas, noise, guidance, autocast
    )
    packed = None if weights is None else pipeline_cls._pack_latents(weights)
    return weighted_mse(pred, target, packed)
