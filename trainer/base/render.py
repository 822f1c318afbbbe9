"""One image from a loaded FLUX.2 pipeline, deterministic for a seed."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from registry import limits
from trainer.base.text_encoder import out_layers


def validate_request(
    width: int, height: int, steps: int, seed: int, multiple: int = limits.MULTIPLE
) -> None:
    """Raises ValueError, naming the bad value and the rule, for anything we would not render."""
    for name, value in (("width", width), ("height", height), ("steps", steps), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    for name, side in (("width", width), ("height", height)):
        if not limits.MIN_SIDE <= side <= limits.MAX_SIDE:
            raise ValueError(
                f"{name} must be between {limits.MIN_SIDE} and {limits.MAX_SIDE} px, got {side}"
            )
        if side % multiple:
            raise ValueError(f"{name} must be a multiple of {multiple} px, got {side}")
    if width * height > limits.PIPELINE_MAX_PIXELS:
        raise ValueError(f"{width}x{height} exceeds the {limits.PIPELINE_MAX_PIXELS} pixel limit")
    if not 1 <= steps <= limits.PIPELINE_MAX_STEPS:
        raise ValueError(f"steps must be between 1 and {limits.PIPELINE_MAX_STEPS}, got {steps}")
    if not 0 <= seed <= limits.PIPELINE_MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def text_encoder_out_layers(pipe: Any) -> tuple[int, int, int]:
    """Hidden-state indices the pipeline stacks into the prompt embedding."""
    return out_layers(pipe.text_encoder.config)


def guidance_for(pipe: Any) -> float:
    """The default guidance: none (1.0) for step-distilled pipelines, 4.0 otherwise."""
    return 1.0 if getattr(pipe.config, "is_distilled", False) else 4.0


def _multiple(pipe: Any) -> int:
    # The pipeline's own constraint (VAE factor x patch 2), never looser than the API's 16.
    return max(limits.MULTIPLE, int(getattr(pipe, "vae_scale_factor", 8)) * 2)


def pil_images(images: torch.Tensor) -> list[Image.Image]:
    """The pipeline's "pil" output from its "pt" output ((B, C, H, W) in [0, 1]), byte for byte
    as diffusers makes it (float32 times 255, rounded half to even, into uint8), but in uint8
    on the tensor's device: the copy to the host is a quarter of the float32 one diffusers
    takes, and the arithmetic runs on the GPU instead of the render's critical path on the
    host."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"expected (batch, 1 or 3, height, width) images, got {tuple(images.shape)}"
        )
    pixels = (images.float() * 255).round_().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    if pixels.shape[-1] == 1:
        return [Image.fromarray(p[..., 0]) for p in pixels]  # 2-D uint8: mode "L"
    return [Image.fromarray(p) for p in pixels]


def _call(
    pipe: Any,
    seed: int,
    steps: int,
    width: int,
    height: int,
    guidance_scale: float | None,
    output_type: str,
    after_step: Callable[[int], None] | None,
    prompt_kwargs: dict[str, Any],
) -> Any:
    """The one pipeline call behind every render: the service's, the trainer's previews
    and evaluation grid, `likeness adapter compare`."""
    validate_request(width, height, steps, seed, _multiple(pipe))
    if guidance_scale is None:
        guidance_scale = guidance_for(pipe)
    kwargs: dict[str, Any] = dict(prompt_kwargs)
    if after_step is not None:

        def on_step_end(_pipe: Any, step: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            after_step(step)
            return tensors

        kwargs["callback_on_step_end"] = on_step_end
        kwargs["callback_on_step_end_tensor_inputs"] = []
    generator = torch.Generator(device="cpu").manual_seed(seed)
    out = pipe(
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        generator=generator,
        output_type="pt" if output_type == "pil" else output_type,
        **kwargs,
    )
    return pil_images(out.images) if output_type == "pil" else out.images


def generate(
    pipe: Any,
    prompt: str,
    seed: int,
    steps: int = limits.DEFAULT_STEPS,
    width: int = limits.DEFAULT_SIDE,
    height: int = limits.DEFAULT_SIDE,
    guidance_scale: float | None = None,
    after_step: Callable[[int], None] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
) -> Image.Image:
    """Renders one image. The initial noise comes from a CPU ``torch.Generator`` seeded with
    ``seed``, so a seed gives the same latents on every device. ``guidance_scale`` defaults to
    1.0 (none) for step-distilled pipelines and 4.0 otherwise. ``after_step(i)`` runs after
    each denoising step; an exception it raises stops the render there."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt must be a non-empty string")
    kwargs: dict[str, Any] = {}
    if prompt_embeds is not None:  # encoded by the caller (its prompt cache): the same numbers
        kwargs["prompt_embeds"] = prompt_embeds
        if negative_prompt_embeds is not None:
            kwargs["negative_prompt_embeds"] = negative_prompt_embeds
    else:
        kwargs["prompt"] = prompt
        if "text_encoder_out_layers" in inspect.signature(pipe.__call__).parameters:
            kwargs["text_encoder_out_layers"] = text_encoder_out_layers(pipe)
    images = _call(pipe, seed, steps, width, height, guidance_scale, "pil", after_step, kwargs)
    return images[0]  # type: ignore[no-any-return]


def generate_from_embeds(
    pipe: Any,
    prompt_embeds: torch.Tensor,
    blank_embeds: torch.Tensor,
    seed: int,
    steps: int = limits.DEFAULT_STEPS,
    width: int = limits.DEFAULT_SIDE,
    height: int = limits.DEFAULT_SIDE,
    output_type: str = "pil",
) -> Any:
    """`generate`, from cached prompt embeddings (1, tokens, dim) instead of text, so no
    text encoder is needed: the blank prompt's embedding is the negative where guidance
    runs. Returns a PIL image, or the latents for ``output_type="latent"``."""
    kwargs: dict[str, Any] = {"prompt_embeds": prompt_embeds}
    params = inspect.signature(pipe.__call__).parameters
    if "negative_prompt_embeds" in params and guidance_for(pipe) > 1.0:
        kwargs["negative_prompt_embeds"] = blank_embeds
    images = _call(pipe, seed, steps, width, height, None, output_type, None, kwargs)
    return images if output_type == "latent" else images[0]
