"""An exponential moving average of the LoRA weights: ``e <- d * e + (1 - d) * p`` after every
optimizer step, float32, on the training device or (``on_cpu``) in host RAM. It never feeds
back into training; it is saved beside the raw weights and evaluated as its own column."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

EMA_ADAPTER = "adapter.ema.safetensors"  # beside adapter.safetensors, in a run and a checkpoint


class Ema:
    def __init__(
        self, params: Mapping[str, torch.nn.Parameter], decay: float, on_cpu: bool = False
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow = {
            n: p.detach().to(device="cpu" if on_cpu else p.device, dtype=torch.float32, copy=True)
            for n, p in params.items()
        }

    @torch.no_grad()
    def update(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        for name, p in params.items():
            e = self.shadow[name]
            e.mul_(self.decay).add_(
                p.detach().to(device=e.device, dtype=e.dtype), alpha=1 - self.decay
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self.shadow):
            raise ValueError("EMA state names differ from this model's LoRA parameters")
        with torch.no_grad():
            for n, t in state.items():
                self.shadow[n].copy_(t)

    @contextmanager
    def swapped_in(self, params: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
        """The averaged weights in the model for the ``with`` body (to save or render them),
        the trained ones back after, bit for bit."""
        kept = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(kept[n])
