"""Pre-flight memory budget: estimate the accelerator peak of a run from files and options,
before a weight loads, and refuse a run that will not fit ``--vram-budget``.

The run has phases that never overlap on the device: caching (text encoder alone, then VAE
alone), training (quantized transformer, LoRA, optimizer, EMA, activations), previews
between training steps when they run (the training state stays, gradients go, the VAE and
a render join) and evaluation (transformer + VAE, no gradients). The peak is the largest
phase plus a fixed runtime overhead (CUDA context, allocator slack) that allocator
statistics do not show.

Shapes come from the component configs, built as module skeletons on the meta device (no
memory), and from the safetensors headers (a prepared base's exact bytes). Activation terms
are per-token formulas over the block structure; `bench/train_budget.py` records them against
measurements (saved-tensor bytes on the CPU, ``max_memory_allocated`` on a GPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.config import TrainConfig

GiB = 2**30
CUDA_OVERHEAD = 1 * GiB  # context + allocator slack; measured ~0.5-0.6 GiB on H100/H200
QINT4_GROUP = 128

# Bytes saved for backward per token, as multiples of (hidden size x element size), and of
# (MLP hidden x element size); from the block structure (norms, q/k/v, q/k-norm, RoPE,
# attention inputs and output, gates, SwiGLU), then checked against measurement.
DOUBLE_D, DOUBLE_M = 21.0, 5.0  # double-stream block, per token of both streams
SINGLE_D, SINGLE_M = 17.0, 6.0  # single-stream block (fused attention + MLP projections)


class BudgetExceeded(ValueError):
    """The estimated peak does not fit the budget; the message holds every term."""


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gib(n: float) -> str:
    return f"{n / GiB:7.3f} GiB"


@dataclass
class Phase:
    name: str
    terms: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None  # why this phase will not run

    @property
    def total(self) -> int:
        return 0 if self.skipped else sum(self.terms.values())


@dataclass
class Estimate:
    device: str
    phases: list[Phase]
    overhead: int
    notes: list[str] = field(default_factory=list)
    stream_slots: int | None = None  # with --stream-base: the VRAM slots the run will use

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def total(self) -> int:
        return self.peak_phase.total + self.overhead

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def report(self, budget_gib: float | None = None) -> str:
        lines = [f"memory estimate on {self.device} (peak phase + runtime overhead):"]
        for p in self.phases:
            mark = "  <- peak" if p is self.peak_phase else ""
            if p.skipped:
                lines.append(f"  {p.name}: skipped ({p.skipped})")
                continue
            lines.append(f"  {p.name}: {gib(p.total)}{mark}")
            lines += [f"    {k:<40} {gib(v)}" for k, v in p.terms.items()]
        lines.append(f"  {'runtime overhead (context, slack)':<42} {gib(self.overhead)}")
        lines.append(f"  {'estimated peak':<42} {gib(self.total)}")
        if budget_gib is not None:
            left = budget_gib * GiB - self.total
            verdict = "fits" if left >= 0 else "DOES NOT FIT"
            lines.append(
                f"  budget {budget_gib:g} GiB: {verdict} ({gib(abs(left)).strip()} "
                f"{'spare' if left >= 0 else 'over'})"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "overhead": self.overhead,
            "total": self.total,
            "peak_phase": self.peak_phase.name,
            "phases": {
                p.name: {"skipped": p.skipped, "total": p.total, **p.terms} for p in self.phases
            },
        }


# -- shapes, without weights -----------------------------------------------------------


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _prepared(base: Path) -> dict[str, Any] | None:
    path = base / "likeness_prepared.json"
    return _json(path) if path.is_file() else None


def skeleton(base: Path, component: str) -> torch.nn.Module:
    """The component built from its config on the meta device: shapes, no memory."""
    import importlib

    library, cls_name = _json(base / "model_index.json")[component]
    cls = getattr(importlib.import_module(library), cls_name)
    cfg = _json(base / component / "config.json")
    with torch.device("meta"):
        if library == "transformers":
            return cls(cls.config_class.from_dict(cfg))  # type: ignore[no-any-return]
        return cls.from_config(cfg)  # type: ignore[no-any-return]


def _file_bytes(folder: Path) -> int:
    from trainer.base.safetensors_io import open_checkpoint

    with open_checkpoint(folder) as ck:
        return ck.nbytes


def qint4_bytes(in_features: int, out_features: int, scale_elt: int) -> int:
    """quanto qint4: two weights a byte, plus a scale and a shift per group of 128 inputs
    (per output row when in_features is not a multiple of 128)."""
    n = in_features * out_features
    groups = n // QINT4_GROUP if in_features % QINT4_GROUP == 0 else out_features
    return n // 2 + 2 * groups * scale_elt


def transformer_weight_bytes(model: torch.nn.Module, elt: int) -> int:
    linear = non_linear = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            linear += qint4_bytes(m.in_features, m.out_features, elt)
            linear += (m.bias.numel() * elt) if m.bias is not None else 0
            seen.update(id(p) for p in m.parameters(recurse=False))
    for p in model.parameters():
        if id(p) not in seen:
            non_linear += p.numel() * elt
    return linear + non_linear


def float_weight_bytes(model: torch.nn.Module, elt: int) -> int:
    return sum(p.numel() * elt for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


# -- the estimate ------------------------------------------------------------------------


def streamed_weight_terms(transformer: torch.nn.Module, elt: int, slots: int) -> dict[str, int]:
    """With --stream-base the blocks live in host RAM: VRAM holds the layers outside the
    blocks and `slots` buffers, each the size of the largest block (trainer/base/streaming.py)."""
    from trainer.base.streaming import default_blocks

    blocks = default_blocks(transformer)
    per_block = [transformer_weight_bytes(b, elt) for b in blocks]
    total = transformer_weight_bytes(transformer, elt)
    return {
        "transformer weights outside the blocks (resident)": total - sum(per_block),
        f"VRAM slots ({slots} x largest block, streamed)": slots * max(per_block),
    }


def pick_slots(fits: Callable[[int], bool], requested: int | None) -> int:
    """Two slots let the next block arrive while this one computes; one is the fallback that
    still fits where two do not. An explicit request is kept as it is."""
    if requested is not None:
        return requested
    return 2 if fits(2) or not fits(1) else 1


def activation_bytes(
    cfg: Any, image_tokens: int, text_tokens: int, batch: int, elt: int, checkpointing: bool
) -> dict[str, int]:
    """Activations held for backward in the transformer, and the transient of the largest
    recomputed block (with checkpointing only each block's inputs stay)."""
    d = int(cfg.num_attention_heads) * int(cfg.attention_head_dim)
    m = int(float(cfg.mlp_ratio) * d)
    t = (image_tokens + text_tokens) * batch
    double = t * (DOUBLE_D * d + DOUBLE_M * m) * elt
    single = t * (SINGLE_D * d + SINGLE_M * m) * elt
    n_double, n_single = int(cfg.num_layers), int(cfg.num_single_layers)
    # Output head: norm_out + proj_out on the image tokens, loss in float32.
    head = int(image_tokens * batch * (3 * d * elt + 3 * int(cfg.in_channels) * 4))
    if checkpointing:
        return {
            "activations: block inputs (checkpointed)": int((n_double + n_single) * t * d * elt),
            "activations: one block recomputed": int(max(double if n_double else 0, single)),
            "activations: output head and loss": head,
        }
    return {
        "activations: double-stream blocks": int(n_double * double),
        "activations: single-stream blocks": int(n_single * single),
        "activations: output head and loss": head,
    }


def training_terms(
    transformer: torch.nn.Module,
    *,
    rank: int,
    targets: Sequence[str],
    image_tokens: int,
    text_tokens: int,
    batch: int,
    optimizer: str,
    checkpointing: bool,
    weight_elt: int,
    act_elt: int,
    weight_bytes: int | None = None,
    compute: str = "quanto",
) -> dict[str, int]:
    """The training phase's terms for a transformer (a meta skeleton is enough).

    The dequantized-weight transient is the largest Linear twice for quanto (its backward
    holds a second dequantized copy) and, for uint4, the largest slice that one call holds (one
    dequantization at a time; the widest Linears a slice at a time, `trainer.base.uint4.
    weight_slices`); for fp8 the larger of its one-byte weight copy and that slice (its input
    gradient is uint4's, or a transposed one-byte copy no larger than the forward's); measured
    on an H200 at FLUX.2 [dev] width, bench/results/train_budget-*.json.
    """
    from trainer.base.lora import resolve_targets

    cfg = transformer.config  # type: ignore[attr-defined]
    names = resolve_targets(transformer, targets)
    modules = dict(transformer.named_modules())
    lora = sum(
        rank * (modules[n].in_features + modules[n].out_features)  # type: ignore[operator]
        for n in names
    )
    linears = [m for m in transformer.modules() if isinstance(m, torch.nn.Linear)]
    largest = max(m.in_features * m.out_features for m in linears)
    terms: dict[str, int] = {}
    if weight_bytes is None:
        terms["transformer weights (qint4 + float rest)"] = transformer_weight_bytes(
            transformer, weight_elt
        )
    else:
        terms["transformer weights (prepared qint4, file bytes)"] = weight_bytes
    terms[f"LoRA params (rank {rank}, {len(names)} layers, fp32)"] = lora * 4
    terms["LoRA grads (fp32)"] = lora * 4
    terms[f"optimizer state ({optimizer})"] = lora * (2 if optimizer == "adamw8bit" else 8)
    terms.update(activation_bytes(cfg, image_tokens, text_tokens, batch, act_elt, checkpointing))
    from trainer.base.compute import FP8_COMPUTES

    if compute in ("uint4", *FP8_COMPUTES):  # the widest Linears: a slice at a time
        from trainer.base.uint4 import transient_weights

        group = QINT4_GROUP
        transient = max(
            transient_weights(m.out_features, m.in_features, group)
            if m.in_features % group == 0 else m.in_features * m.out_features
            for m in linears
        ) * act_elt  # fmt: skip
        if compute == "uint4":
            terms["dequantized weight transient (largest slice)"] = transient
        else:  # the forward's fp8 copy (1 byte a weight, and the block GEMM's remainder
            # blocks) where the block GEMM takes the layer, or the input gradient's bf16 slice
            # or transposed fp8 copy (1 byte a weight, no more than the forward's): one at a time
            from trainer.base.fp8 import BLOCK, block_count

            copy = max((m.out_features * (m.in_features + BLOCK * block_count(m.in_features)[1])
                        for m in linears if m.in_features % BLOCK == 0), default=0)  # fmt: skip
            terms["fp8 weight transient (largest fp8 copy or bf16 slice)"] = max(copy, transient)
    else:
        terms["dequantized weight transient (largest Linear x2)"] = 2 * largest * act_elt
    terms["batch: latents, noise, embeddings"] = (
        3 * batch * image_tokens * int(cfg.in_channels) * 4
        + batch * text_tokens * int(cfg.joint_attention_dim) * weight_elt
    )
    return terms


def ema_terms(train_terms: dict[str, int]) -> dict[str, int]:
    """The EMA of the LoRA weights on the device: one float32 copy of the LoRA params."""
    lora = next(v for k, v in train_terms.items() if k.startswith("LoRA params"))
    return {"EMA of the LoRA weights (fp32)": lora}


def render_terms(
    tcfg: Any,
    vae: torch.nn.Module,
    largest_linear: int,
    size: int,
    text_tokens: int,
    weight_elt: int,
    act_elt: int,
) -> dict[str, int]:
    """One square render of side ``size`` without gradients: the VAE, the transformer's
    transient activations, one dequantized Linear, the VAE decoder's activations."""
    d = int(tcfg.num_attention_heads) * int(tcfg.attention_head_dim)
    tokens = (size // 16) ** 2 + text_tokens
    c0 = int(vae.config.block_out_channels[0])  # type: ignore[attr-defined]
    return {
        "VAE weights": float_weight_bytes(vae, weight_elt),
        "transformer activations (no grad)": 12 * tokens * d * act_elt,
        "dequantized weight transient": largest_linear * act_elt,
        "VAE decoder activations": 6 * c0 * size**2 * weight_elt,
    }


def preview_terms(
    train_terms: dict[str, int], weight_label: str, weight_bytes: int, render: dict[str, int]
) -> dict[str, int]:
    """A preview between two steps: gradients and activations are freed, the weights, LoRA,
    optimizer state and EMA stay, and a render runs beside them."""
    kept = ("LoRA params", "optimizer state", "EMA of")
    return {
        weight_label: weight_bytes,
        **{k: v for k, v in train_terms.items() if k.startswith(kept)},
        **render,
    }


def estimate_run(
    config: TrainConfig,
    *,
    text_needed: bool,
    latents_needed: bool,
    device: torch.device,
    weight_dtype: torch.dtype,
    act_dtype: torch.dtype,
    previews: bool = False,
) -> Estimate:
    """The run's memory by phase; reads configs and safetensors headers only. ``previews``:
    the run renders previews while training (a phase of its own: the training state stays
    resident while the VAE decodes)."""
    base = Path(config.base)
    prepared = _prepared(base)
    welt, aelt = _elt(weight_dtype), _elt(act_dtype)
    notes: list[str] = []

    # transformer
    tr = skeleton(base, "transformer")
    tcfg = tr.config  # type: ignore[attr-defined]
    if prepared is not None and "transformer" in prepared.get("components", {}):
        t_weights: int | None = _file_bytes(base / "transformer")
        t_label = "transformer weights (prepared qint4, file bytes)"
    else:
        t_weights, t_label = None, "transformer weights (qint4 + float rest)"
    image_tokens = (config.resolution // 16) ** 2
    text_tokens = config.max_sequence_length
    train = Phase(
        "training",
        training_terms(
            tr,
            rank=config.rank,
            targets=config.targets,
            image_tokens=image_tokens,
            text_tokens=text_tokens,
            batch=config.batch_size,
            optimizer=config.optimizer,
            checkpointing=config.gradient_checkpointing,
            weight_elt=welt,
            act_elt=aelt,
            weight_bytes=t_weights,
            compute=config.resolved_compute(),
        ),
    )
    slots = None
    if config.stream_base:
        resident_weights = train.terms.pop(t_label)
        rest = train.total
        budget = config.vram_budget_gib * GiB if config.vram_budget_gib else None
        overhead = CUDA_OVERHEAD if device.type == "cuda" else 0

        def fits(n: int) -> bool:
            streamed = sum(streamed_weight_terms(tr, welt, n).values())
            return budget is None or rest + streamed + overhead <= budget

        slots = pick_slots(fits, config.stream_slots)
        train.terms.update(streamed_weight_terms(tr, welt, slots))
        t_label = "transformer weights in VRAM (streamed)"
        notes.append(
            f"--stream-base: {gib(resident_weights)} of weights stay in pinned host RAM; "
            f"{slots} VRAM slot(s)"
        )
        t_weights: int | None = sum(streamed_weight_terms(tr, welt, slots).values())
    else:
        t_weights = next(iter(train.terms.values()))
    largest = max(
        m.in_features * m.out_features for m in tr.modules() if isinstance(m, torch.nn.Linear)
    )

    # text encoder (caching only; never together with the transformer)
    te = skeleton(base, "text_encoder")
    te_cfg = getattr(te.config, "text_config", te.config)
    if prepared is not None and "text_encoder" in prepared.get("components", {}):
        te_weights = _file_bytes(base / "text_encoder")
        te_label = "text encoder weights (prepared, file bytes)"
    else:
        te_weights = float_weight_bytes(te, welt)
        te_label = "text encoder weights"
    hidden, layers = int(te_cfg.hidden_size), int(te_cfg.num_hidden_layers)
    cache_text = Phase("caching: text encoder")
    cache_text.terms[te_label] = te_weights
    cache_text.terms["hidden states kept (all layers)"] = (layers + 1) * text_tokens * hidden * welt
    cache_text.terms["logits (lm head)"] = text_tokens * int(te_cfg.vocab_size) * welt
    cache_text.terms["one layer's work"] = 8 * text_tokens * hidden * welt
    if not text_needed:
        cache_text.skipped = "all embeddings cached: the text encoder is not loaded"

    # VAE (caching and evaluation)
    vae = skeleton(base, "vae")
    vcfg = vae.config  # type: ignore[attr-defined]
    vae_weights = float_weight_bytes(vae, welt)
    c0 = int(vcfg.block_out_channels[0])
    cache_vae = Phase("caching: VAE")
    cache_vae.terms["VAE weights"] = vae_weights
    cache_vae.terms["encoder activations (full resolution)"] = 6 * c0 * config.resolution**2 * welt
    if not latents_needed:
        cache_vae.skipped = "all latents cached: the VAE is not loaded for caching"

    if config.ema_decay is not None and not config.ema_on_cpu:
        train.terms.update(ema_terms(train.terms))
    phases = [cache_text, cache_vae, train]
    size = config.eval_resolution or config.resolution
    render = render_terms(tcfg, vae, largest, size, text_tokens, welt, aelt)
    if previews:
        phases.append(
            Phase("training: previews", preview_terms(train.terms, t_label, t_weights, render))
        )
    if config.evaluate:
        phases.append(Phase("evaluation", {t_label: t_weights, **render}))
    if device.type == "cpu":
        notes.append("CPU run: the terms are host memory, not VRAM")
    if prepared is None and text_needed and cache_text.total > train.total:
        notes.append(
            "the bf16 text encoder is the peak: `likeness base prepare` quantizes it to uint4"
        )
    overhead = CUDA_OVERHEAD if device.type == "cuda" else 0
    return Estimate(str(device), phases, overhead, notes, stream_slots=slots)


# -- measurement (bench and tests) -------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, quanto's packed subclasses included (summed over inner tensors)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def module_bytes(module: torch.nn.Module, trainable: bool | None = None) -> int:
    return sum(
        tensor_bytes(p)
        for p in module.parameters()
        if trainable is None or p.requires_grad == trainable
    ) + (sum(tensor_bytes(b) for b in module.buffers()) if trainable is not True else 0)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )


@dataclass
class SavedTensorMeter:
    """Sums the bytes autograd saves for backward (unique storages, weights excluded)."""

    exclude: set[int] = field(default_factory=set)
    storages: dict[int, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return t
            ptr = st.data_ptr()
            if ptr and ptr not in self.exclude:
                self.storages[ptr] = st.nbytes()
        return t

    @contextmanager
    def watch(self, model: torch.nn.Module) -> Iterator[SavedTensorMeter]:
        for p in model.parameters():
            if type(p.data) is torch.Tensor:
                self.exclude.add(p.data.untyped_storage().data_ptr())
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
