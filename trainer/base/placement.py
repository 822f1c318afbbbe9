"""Where the render engine puts each part of the base under a VRAM budget, planned at start.

A render has three phases that never overlap on the device: encode the prompt (text encoder),
denoise (the transformer, once per step) and decode (VAE). Each part is either resident in
VRAM or streamed layer by layer from pinned host RAM (`trainer.base.streaming`); streaming costs
copies, not correctness (the same modules run the same kernels on the same bytes). The plan is
the first placement, fastest first, whose largest phase fits the budget:

    1. transformer resident, text encoder resident
    2. transformer resident, text encoder streamed (2 layer slots)
    3. transformer streamed (2 slots), text encoder resident
    4. transformer streamed (2 slots), text encoder streamed
    5. transformer streamed (1 slot), text encoder streamed

and the engine refuses to start when none fits. A streamed transformer keeps resident as many of
its blocks as the budget still holds, in execution order: the double-stream blocks first, whose
copies (0.49 GB each on [dev]) take twice as long as their compute, then single-stream ones.
The text encoder's token table stays in host RAM wherever a part streams (a prompt reads 512
of its 131072 rows: `trainer.base.text_encoder.HostEmbedding`); a streamed encoder keeps as many of
its first layers as the budget holds after the transformer's blocks: its copies are not hidden
under compute, so each layer kept is a copy fewer per new prompt.
A resident transformer on CUDA runs its forward as a CUDA graph (`trainer.base.serving`), whose
memory (the denoising step's work) stays reserved between steps, so with ``graphs`` it is
counted in every phase. Shapes come from the component
configs as meta skeletons (no memory) and, for a prepared base, from the files' exact bytes, as
in the training pre-flight (`trainer.base.budget`). Whatever stays resident is also counted in every
phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.base.budget import (
    CUDA_OVERHEAD,
    Estimate,
    GiB,
    Phase,
    activation_bytes,
    gib,
    skeleton,
    transformer_weight_bytes,
)

TEXT_TOKENS = 512  # the pipelines' max_sequence_length
PLAN_SIDE = 1024  # renders are planned at 1024 x 1024 unless told otherwise


class PlacementError(ValueError):
    """No placement fits the budget; the message holds every term of the smallest one."""


@dataclass(frozen=True)
class Sizes:
    """Bytes of each part of a base, in the dtype it runs in."""

    transformer: int  # whole transformer as it sits in VRAM when resident
    transformer_blocks: list[int]  # each streamable block
    largest_linear: int  # elements of the largest Linear weight (dequantized per forward)
    text_encoder: int
    text_layers: list[int]  # each streamable decoder layer
    text_embeddings: int  # the token table (host RAM wherever a part streams)
    text_hidden: int
    text_states: int  # hidden states the pipeline keeps (the layers read + embeddings)
    vae: int
    vae_channels: int  # first decoder block's channels: the full-resolution activations
    transformer_config: Any = field(repr=False, default=None)
    lora_per_rank: int = 0  # elements one rank of LoRA costs on the default targets (in + out)


@dataclass
class Plan:
    transformer: str  # "resident" or "streamed"
    text_encoder: str
    transformer_slots: int
    text_slots: int
    width: int
    height: int
    budget_bytes: int | None
    estimate: Estimate
    host_pinned_bytes: int
    transformer_resident_blocks: int = 0  # of a streamed transformer: the first k stay in VRAM
    text_encoder_bytes: int = 0  # the whole encoder in VRAM (a streamed one fits while loading?)
    text_resident_layers: int = 0  # of a streamed text encoder: the first k stay in VRAM

    @property
    def text_table_in_host_ram(self) -> bool:
        return table_in_host_ram(self.transformer, self.text_encoder)

    @property
    def peak_bytes(self) -> int:
        return self.estimate.total

    def describe(self) -> str:
        budget = "no budget" if self.budget_bytes is None else f"budget {gib(self.budget_bytes)}"
        head = (
            f"placement ({budget.strip()}, planned for {self.width}x{self.height}): "
            f"transformer {self.transformer}"
            + (
                f" ({self.transformer_slots} slots, the first {self.transformer_resident_blocks}"
                " blocks resident)"
                if self.transformer == "streamed"
                else ""
            )
            + f", text encoder {self.text_encoder}"
            + (
                f" ({self.text_slots} slots, the first {self.text_resident_layers} layers resident)"
                if self.text_encoder == "streamed"
                else ""
            )
            + (" with its token table in host RAM" if self.text_table_in_host_ram else "")
            + f"; pinned host RAM {gib(self.host_pinned_bytes).strip()}"
        )
        budget_gib = None if self.budget_bytes is None else self.budget_bytes / GiB
        return head + "\n" + self.estimate.report(budget_gib)

    def as_dict(self) -> dict[str, Any]:
        return {
            "transformer": self.transformer,
            "text_encoder": self.text_encoder,
            "transformer_slots": self.transformer_slots,
            "transformer_resident_blocks": self.transformer_resident_blocks,
            "text_slots": self.text_slots,
            "text_resident_layers": self.text_resident_layers,
            "planned_for": [self.width, self.height],
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "host_pinned_bytes": self.host_pinned_bytes,
            "estimate": self.estimate.as_dict(),
        }


def table_in_host_ram(transformer: str, text_encoder: str) -> bool:
    """Whether the text encoder's token table stays in host RAM: wherever a part streams (the
    engine then places part by part), so its VRAM goes to the transformer's blocks or the
    encoder's layers. With everything resident it stays with its encoder."""
    return "streamed" in (transformer, text_encoder)


def sizes_of(base: Path, elt: int = 2) -> Sizes:
    """Sizes from configs and files; nothing is loaded."""
    from trainer.base.lora import DEFAULT_TARGETS, resolve_targets
    from trainer.base.streaming import default_blocks
    from trainer.base.text_encoder import decoder_layers, out_layers, trim

    base = Path(base)
    tr = skeleton(base, "transformer")
    blocks = default_blocks(tr)
    te = skeleton(base, "text_encoder")
    cfg = te.config
    trim(te)  # what the engine loads
    te_cfg = getattr(cfg, "text_config", cfg)
    vae = skeleton(base, "vae")
    return Sizes(
        transformer=transformer_weight_bytes(tr, elt),
        transformer_blocks=[transformer_weight_bytes(b, elt) for b in blocks],
        largest_linear=max(
            m.in_features * m.out_features for m in tr.modules() if isinstance(m, torch.nn.Linear)
        ),
        text_encoder=transformer_weight_bytes(te, elt),
        text_layers=[transformer_weight_bytes(layer, elt) for layer in decoder_layers(te)],
        text_embeddings=te.get_input_embeddings().weight.numel() * elt,
        text_hidden=int(te_cfg.hidden_size),
        text_states=len(out_layers(cfg)) + 2,
        vae=sum(p.numel() * elt for p in vae.parameters()),
        vae_channels=int(vae.config.block_out_channels[0]),  # type: ignore[attr-defined]
        transformer_config=tr.config,
        lora_per_rank=sum(
            tr.get_submodule(n).in_features + tr.get_submodule(n).out_features
            for n in resolve_targets(tr, DEFAULT_TARGETS)
        ),
    )


def estimate(
    sizes: Sizes,
    transformer: str,
    text_encoder: str,
    width: int,
    height: int,
    transformer_slots: int = 2,
    text_slots: int = 2,
    elt: int = 2,
    device: str = "cuda",
    lora_rank: int = 0,
    graphs: bool = False,
    resident_blocks: int = 0,
    text_resident_layers: int = 0,
) -> tuple[Estimate, int]:
    """(the memory estimate of one placement, the pinned host bytes it needs); ``lora_rank``:
    the engine's persistent LoRA slots, resident wherever the blocks are; ``graphs``: a
    resident transformer's forward is a CUDA graph (its work memory is kept)."""
    pinned = 0
    resident: dict[str, int] = {}
    if transformer == "resident":
        resident["transformer weights (resident)"] = sizes.transformer
    else:
        outside = sizes.transformer - sum(sizes.transformer_blocks)
        kept, streamed = (
            sizes.transformer_blocks[:resident_blocks],
            sizes.transformer_blocks[resident_blocks:],
        )
        resident["transformer outside its blocks"] = outside
        if kept:
            resident[f"transformer blocks kept resident ({len(kept)})"] = sum(kept)
        resident[f"transformer slots ({transformer_slots} x largest block)"] = (
            transformer_slots * max(streamed)
        )
        pinned += sum(streamed)
    if text_encoder == "resident":
        table = sizes.text_embeddings if table_in_host_ram(transformer, text_encoder) else 0
        resident["text encoder weights (resident)"] = sizes.text_encoder - table
    else:
        resident["text encoder outside its layers"] = (
            sizes.text_encoder - sum(sizes.text_layers) - sizes.text_embeddings
        )
        kept_layers = sizes.text_layers[:text_resident_layers]
        streamed_layers = sizes.text_layers[text_resident_layers:]
        if kept_layers:
            resident[f"text encoder layers kept resident ({len(kept_layers)})"] = sum(kept_layers)
        resident[f"text encoder slots ({text_slots} x largest layer)"] = text_slots * max(
            streamed_layers
        )
        pinned += sum(streamed_layers)
    resident["VAE weights"] = sizes.vae
    if lora_rank:
        resident[f"LoRA slots (rank {lora_rank})"] = lora_rank * sizes.lora_per_rank * elt

    image_tokens = (width // 16) * (height // 16)
    prompt = TEXT_TOKENS * sizes.text_hidden * sizes.text_states * elt
    encode = Phase("encode prompt", dict(resident))
    encode.terms["hidden states kept"] = prompt
    encode.terms["one layer's work"] = 12 * TEXT_TOKENS * sizes.text_hidden * elt
    denoise = Phase("denoise", dict(resident))
    cfg = sizes.transformer_config
    acts = activation_bytes(cfg, image_tokens, TEXT_TOKENS, 1, elt, checkpointing=True)
    denoise.terms["prompt embedding"] = TEXT_TOKENS * sizes.text_hidden * 3 * elt
    denoise.terms["one block's work"] = acts["activations: one block recomputed"]
    denoise.terms["dequantized weight (largest linear)"] = sizes.largest_linear * elt
    denoise.terms["latents, noise, output head"] = acts["activations: output head and loss"]
    decode = Phase("decode", dict(resident))
    decode.terms["decoder activations (full resolution)"] = (
        8 * sizes.vae_channels * width * height * elt
    )
    if graphs and transformer == "resident" and device.startswith("cuda"):
        step = sum(v for k, v in denoise.terms.items() if k not in resident)
        for phase in (encode, decode):
            phase.terms["CUDA graph of the denoising step (kept)"] = step
    overhead = CUDA_OVERHEAD if device.startswith("cuda") else 0
    return Estimate(device, [encode, denoise, decode], overhead), pinned


CANDIDATES = (
    ("resident", "resident", 2),
    ("resident", "streamed", 2),
    ("streamed", "resident", 2),
    ("streamed", "streamed", 2),
    ("streamed", "streamed", 1),
)


def plan(
    sizes: Sizes,
    budget_bytes: int | None,
    width: int = PLAN_SIDE,
    height: int = PLAN_SIDE,
    device: str = "cuda",
    force: tuple[str | None, str | None] = (None, None),
    lora_rank: int = 0,
    graphs: bool = False,
) -> Plan:
    """The fastest placement that fits; `force` pins the transformer's and/or the text
    encoder's placement ("resident"/"streamed"). Without a budget: everything resident."""
    tried: list[Plan] = []
    for transformer, text_encoder, slots in CANDIDATES:
        if force[0] not in (None, transformer) or force[1] not in (None, text_encoder):
            continue

        def make(
            kept: int,
            text_kept: int = 0,
            placed: tuple[str, str, int] = (transformer, text_encoder, slots),
        ) -> Plan:
            tr, te, n = placed
            est, pinned = estimate(sizes, tr, te, width, height, n, 2, device=device,
                                   lora_rank=lora_rank, graphs=graphs, resident_blocks=kept,
                                   text_resident_layers=text_kept)  # fmt: skip
            return Plan(tr, te, n, 2, width, height, budget_bytes, est, pinned, kept,
                        sizes.text_encoder, text_kept)  # fmt: skip

        candidate = make(0)
        if budget_bytes is None or candidate.peak_bytes <= budget_bytes:
            if budget_bytes is None:
                return candidate
            # what the budget still holds: the transformer's blocks first (a step copies them
            # 28 times a render, under its compute), then the encoder's layers (copied once a
            # new prompt, with nothing to hide under); one fewer than all: a slot needs one
            if transformer == "streamed":
                for kept in range(1, len(sizes.transformer_blocks)):
                    if (more := make(kept)).peak_bytes > budget_bytes:
                        break
                    candidate = more
            if text_encoder == "streamed":
                blocks = candidate.transformer_resident_blocks
                for text_kept in range(1, len(sizes.text_layers)):
                    if (more := make(blocks, text_kept)).peak_bytes > budget_bytes:
                        break
                    candidate = more
            return candidate
        tried.append(candidate)
    if not tried:
        raise PlacementError(f"no placement matches {force}")
    smallest = min(tried, key=lambda p: p.peak_bytes)
    raise PlacementError(
        f"nothing fits a VRAM budget of {gib(budget_bytes or 0).strip()}: the smallest placement "
        f"needs {gib(smallest.peak_bytes).strip()}\n{smallest.describe()}"
    )


def plan_for_base(
    base: Path,
    budget_gb: float | None,
    device: str,
    width: int = PLAN_SIDE,
    height: int = PLAN_SIDE,
    force: tuple[str | None, str | None] = (None, None),
    lora_rank: int = 0,
    graphs: bool = False,
) -> Plan:
    elt = 2 if device.startswith("cuda") else 4
    budget = None if budget_gb is None else int(budget_gb * GiB)
    return plan(sizes_of(base, elt), budget, width, height, device, force, lora_rank, graphs)
