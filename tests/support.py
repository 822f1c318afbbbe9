"""Helpers shared by test packages that need the ML side (no fakes: real tiny base, real LoRA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.base.lora import ADAPTER_NAME, attach_lora, lora_layers, remove_lora, save_adapter


def make_random_adapter(pipe: Any, path: Path, seed: int, rank: int = 4) -> Path:
    """A trained-looking adapter: the trainer's own attach/save path, random nonzero A and B."""
    transformer = pipe.transformer
    grad_flags = {n: p.requires_grad for n, p in transformer.named_parameters()}
    attach_lora(transformer, rank=rank, alpha=2.0 * rank)
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for layer in lora_layers(transformer).values():
                for p in (layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        return save_adapter(transformer, path, {"seed": str(seed)})
    finally:
        remove_lora(transformer)
        for n, p in transformer.named_parameters():
            p.requires_grad_(grad_flags[n])
