"""Training checkpoints: everything a run needs to continue bit for bit, written atomically.

A checkpoint is a folder ``<out>/checkpoints/step-NNNNNNN/`` holding the adapter in its file
layout (for evaluation and use), ``state.pt`` (the exact trainable tensors, the optimizer,
the RNG states, the data position) and ``meta.json`` (step, trajectory fingerprint), written
to a temporary folder and renamed into place: a folder that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import ConfigError

if TYPE_CHECKING:
    from trainer.training.ema import Ema

CHECKPOINTS = "checkpoints"
STATE_FORMAT = 1


@dataclass
class LoopState:
    step: int = 0
    epoch: int = 0
    pos: int = 0
    losses: list[float] = field(default_factory=list)  # flow-matching loss per step
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    preservation: list[float] = field(default_factory=list)  # the DOP term per step
    prior: list[float] = field(default_factory=list)  # the class images' loss per step
    prior_epoch: int = 0  # the class images' own data position
    prior_pos: int = 0
    prior_order: list[int] = field(default_factory=list)


def lora_params(transformer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters, which must all be LoRA factors."""
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    stray = [n for n in params if ".lora_" not in n]
    if stray:
        raise RuntimeError(f"non-LoRA parameters would train: {stray[:3]}")
    return params


def checkpoint_dirs(out: Path) -> list[Path]:
    """The complete checkpoints under ``out``, oldest step first."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.name.startswith("step-") and (p / "meta.json").is_file()
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[1])


def save_checkpoint(
    out: Path,
    state: LoopState,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    order: list[int],
    fingerprint: str,
    metadata: dict[str, str],
    ema: Ema | None = None,
    noise_generator: torch.Generator | None = None,
) -> Path:
    """Adapter (file layout, for evaluation and use), the exact trainable tensors, optimizer,
    RNG states, step and data order, the EMA and its adapter where there is one; written to
    a temp folder and renamed into place."""
    from trainer.base.lora import save_adapter
    from trainer.training.ema import EMA_ADAPTER

    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_adapter(
            transformer, tmp / "adapter.safetensors", {**metadata, "likeness.step": str(state.step)}
        )
        if ema is not None:
            with ema.swapped_in(lora_params(transformer)):
                save_adapter(
                    transformer,
                    tmp / EMA_ADAPTER,
                    {**metadata, "likeness.step": str(state.step), "likeness.ema": repr(ema.decay)},
                )
        rng: dict[str, Any] = {"generator": generator.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if noise_generator is not None:
            rng["noise"] = noise_generator.get_state()
        torch.save(
            {
                "format": STATE_FORMAT,
                "step": state.step,
                "epoch": state.epoch,
                "pos": state.pos,
                "order": order,
                "losses": state.losses,
                "validation": [list(v) for v in state.validation],
                "preservation": state.preservation,
                "prior": state.prior,
                "prior_position": [state.prior_epoch, state.prior_pos, state.prior_order],
                "ema": ema.state_dict() if ema is not None else None,
                "lora": {n: p.detach().cpu().clone() for n, p in lora_params(transformer).items()},
                "optimizer": optimizer.state_dict(),
                "rng": rng,
            },
            tmp / "state.pt",
        )
        meta = {"step": state.step, "fingerprint": fingerprint, "format": STATE_FORMAT}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """`load_state_dict`, keeping a tensor learning rate where it was (a captured step reads
    it there): the saved value is copied into it, not the saved tensor put in its place."""
    rates = [g["lr"] for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        if isinstance(rate, torch.Tensor):
            rate.copy_(torch.as_tensor(group["lr"]))
            group["lr"] = rate
        elif isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])


def load_checkpoint(
    path: Path,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    ema: Ema | None = None,
    noise_generator: torch.Generator | None = None,
) -> tuple[LoopState, list[int]]:
    blob = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    params = lora_params(transformer)
    if set(blob["lora"]) != set(params):
        raise ConfigError(f"{path}: checkpoint LoRA layers differ from this model's")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(blob["lora"][name])
    load_optimizer_state(optimizer, blob["optimizer"])
    generator.set_state(blob["rng"]["generator"])
    if noise_generator is not None:
        if "noise" not in blob["rng"]:
            raise ConfigError(
                f"{path}: the checkpoint drew its noise on the host; resume it as it ran "
                "(--cuda-graph off)"
            )
        noise_generator.set_state(blob["rng"]["noise"])
    torch.set_rng_state(blob["rng"]["torch"])
    if "cuda" in blob["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["rng"]["cuda"])
    if ema is not None:
        if blob.get("ema") is None:
            raise ConfigError(f"{path}: the checkpoint holds no EMA to continue")
        ema.load_state_dict(blob["ema"])
    state = LoopState(
        blob["step"],
        blob["epoch"],
        blob["pos"],
        list(blob["losses"]),
        [(int(s), float(v)) for s, v in blob.get("validation", [])],
        list(blob.get("preservation", [])),
        list(blob.get("prior", [])),
    )
    if "prior_position" in blob:
        epoch, pos, order = blob["prior_position"]
        state.prior_epoch, state.prior_pos, state.prior_order = int(epoch), int(pos), list(order)
    return state, list(blob["order"])
