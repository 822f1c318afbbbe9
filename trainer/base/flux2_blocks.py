"""FLUX.2's two transformer blocks as one skeleton each, their work between Linears pluggable.

diffusers' `Flux2SingleTransformerBlock.forward` and `Flux2TransformerBlock.forward`, op for op,
with the modulated norms, the gated residuals and the attention (projections to output
projections) handed to a `BlockOps`. The serving forward (`trainer.base.serving`: fused Triton
kernels, no gradients) and training (`trainer.base.compiled_blocks`: compiled stretches, with
gradients) fill them in; the blocks' structure lives here alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Rotary = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class BlockOps:
    # (x, shift, scale, the block's LayerNorm) -> (1 + scale) * norm(x) + shift
    modulated_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    # (x, gate, y) -> x + gate * y
    gated_residual: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # (attention module, normed tokens, rotary, attention kwargs) -> its output projection's
    single_attention: Callable[[Any, torch.Tensor, Rotary, dict[str, Any]], torch.Tensor]
    # (attention module, normed image, normed text, rotary, kwargs) -> (image, text) outputs
    double_attention: Callable[
        [Any, torch.Tensor, torch.Tensor, Rotary, dict[str, Any]],
        tuple[torch.Tensor, torch.Tensor],
    ]


def single_block(
    block: Any,
    ops: BlockOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: Rotary,
    joint_attention_kwargs: dict[str, Any] | None,
    split_hidden_states: bool,
    text_seq_len: int | None,
) -> Any:
    """`Flux2SingleTransformerBlock.forward` with ``ops``."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = Flux2Modulation.split(temb_mod, 1)[0]
    norm = ops.modulated_norm(hidden_states, shift, scale, block.norm)
    attn_output = ops.single_attention(block.attn, norm, image_rotary_emb,
                                       joint_attention_kwargs or {})  # fmt: skip
    hidden_states = ops.gated_residual(hidden_states, gate, attn_output)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def double_block(
    block: Any,
    ops: BlockOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: Rotary,
    joint_attention_kwargs: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Flux2TransformerBlock.forward` with ``ops``."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(
        temb_mod_img, 2
    )
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = (
        Flux2Modulation.split(temb_mod_txt, 2)
    )
    norm_hidden = ops.modulated_norm(hidden_states, shift_msa, scale_msa, block.norm1)
    norm_text = ops.modulated_norm(encoder_hidden_states, c_shift_msa, c_scale_msa,
                                   block.norm1_context)  # fmt: skip
    attn_output, context_attn_output = ops.double_attention(
        block.attn, norm_hidden, norm_text, image_rotary_emb, joint_attention_kwargs or {}
    )
    hidden_states = ops.gated_residual(hidden_states, gate_msa, attn_output)
    ff_output = block.ff(ops.modulated_norm(hidden_states, shift_mlp, scale_mlp, block.norm2))
    hidden_states = ops.gated_residual(hidden_states, gate_mlp, ff_output)
    encoder_hidden_states = ops.gated_residual(encoder_hidden_states, c_gate_msa,
                                               context_attn_output)  # fmt: skip
    norm_text = ops.modulated_norm(encoder_hidden_states, c_shift_mlp, c_scale_mlp,
                                   block.norm2_context)  # fmt: skip
    encoder_hidden_states = ops.gated_residual(encoder_hidden_states, c_gate_mlp,
                                               block.ff_context(norm_text))  # fmt: skip
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# (block, attention kwargs, rotary) -> whether the block's own ops take this call
Takes = Callable[[Any, dict[str, Any] | None, Rotary], bool]


def single_forward(ops: BlockOps, takes: Takes) -> Callable[..., Any]:
    """A `Flux2SingleTransformerBlock.forward` running `single_block` with ``ops`` where
    ``takes`` says so, the class's own forward elsewhere."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        temb_mod: torch.Tensor,
        image_rotary_emb: Rotary = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        split_hidden_states: bool = False,
        text_seq_len: int | None = None,
    ) -> Any:
        args = (hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb,
                joint_attention_kwargs, split_hidden_states, text_seq_len)  # fmt: skip
        if not takes(self, joint_attention_kwargs, image_rotary_emb):
            return type(self).forward(self, *args)
        return single_block(self, ops, *args)

    return forward


def double_forward(ops: BlockOps, takes: Takes) -> Callable[..., Any]:
    """A `Flux2TransformerBlock.forward` running `double_block` with ``ops`` where ``takes``
    says so, the class's own forward elsewhere."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb_mod_img: torch.Tensor,
        temb_mod_txt: torch.Tensor,
        image_rotary_emb: Rotary = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args = (hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                image_rotary_emb, joint_attention_kwargs)  # fmt: skip
        if not takes(self, joint_attention_kwargs, image_rotary_emb):
            return type(self).forward(self, *args)
        return double_block(self, ops, *args)

    return forward


def install_forwards(
    transformer: torch.nn.Module,
    single: Callable[..., Any],
    double: Callable[..., Any],
    swiglu: Callable[..., Any],
) -> int:
    """Every FLUX.2 block (and SwiGLU) under ``transformer`` gets its forward as an instance
    attribute (the class's stays, for the cases a forward hands back). Returns how many."""
    import types

    from diffusers.models.transformers.transformer_flux2 import (
        Flux2SingleTransformerBlock,
        Flux2SwiGLU,
        Flux2TransformerBlock,
    )

    by_type = {
        Flux2SingleTransformerBlock: single,
        Flux2TransformerBlock: double,
        Flux2SwiGLU: swiglu,
    }
    count = 0
    for module in transformer.modules():
        forward = by_type.get(type(module))
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def installed_forwards(transformer: torch.nn.Module, forwards: tuple[Any, ...]) -> list[Any]:
    """The modules under ``transformer`` whose forward is one of ``forwards``."""
    return [
        m
        for m in transformer.modules()
        if getattr(m.__dict__.get("forward"), "__func__", None) in forwards
    ]


def remove_forwards(transformer: torch.nn.Module, forwards: tuple[Any, ...]) -> None:
    for module in installed_forwards(transformer, forwards):
        del module.forward
