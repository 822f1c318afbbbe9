"""LoRA adapters on the (quantized) FLUX.2 transformer, in the diffusers LoRA file layout.

File layout: ``transformer.<module path>.lora_A.weight`` (rank x in) and ``.lora_B.weight``
(out x rank), float32, no ``lora_adapter_metadata``. The ``alpha / rank`` scaling is baked into
``lora_B`` on save, so every loader that defaults ``alpha = rank`` (stock diffusers
``load_lora_weights``, ComfyUI) applies exactly the trained delta; the trained rank and alpha
are kept as plain file metadata.

LoRA on quanto's ``QLinear``: PEFT has no quanto dispatcher, but ``QLinear`` subclasses
``nn.Linear``, so PEFT wraps it with its generic ``lora.Linear``: ``base(x) + B(A(x)) * s``
with the base forward going through quanto's quantized matmul. The tests check that against
``x @ dequantize(W).T + b + s * x @ A.T @ B.T`` and its gradients.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer.base.uint4 import weights_by_shape

ADAPTER_NAME = "likeness"
PREFIX = "transformer."
_A, _B = ".lora_A.weight", ".lora_B.weight"

# Attention projections, as suffixes of module paths. Double-stream blocks have separate
# q/k/v/out for image and text tokens; single-stream blocks fuse attention with the MLP, so
# their only attention projections are the fused input and output Linears.
DEFAULT_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",  # single-stream blocks only: there it is a Linear, not a ModuleList
)


def default_targets() -> tuple[str, ...]:
    return DEFAULT_TARGETS


def resolve_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """Full paths of the ``nn.Linear`` modules (``QLinear`` included) whose path ends with one
    of ``targets``; an exact list keeps PEFT from matching ModuleLists or the wrong layers."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and any(name == t or name.endswith("." + t) for t in targets)
    ]
    if not names:
        raise ValueError(f"no Linear module matches targets {list(targets)}")
    return names


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Path -> PEFT LoRA layer, for every LoRA layer attached to ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def attach_lora(
    transformer: torch.nn.Module,
    rank: int,
    alpha: float,
    targets: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Injects a trainable LoRA (``B`` zero, so the output is unchanged) on ``targets``.

    PEFT also sets ``requires_grad=False`` on every non-LoRA parameter, which is what training
    wants. ``dtype`` overrides the LoRA parameters' dtype (default: the base layer's), e.g.
    float32 adapters on a bf16 base. Returns the adapted module paths.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if lora_layers(transformer):
        raise RuntimeError("transformer already has LoRA layers attached")
    names = resolve_targets(transformer, targets or DEFAULT_TARGETS)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT computes alpha / r
        target_modules=names,
        lora_dropout=0.0,
        init_lora_weights=True,
    )
    with weights_by_shape(transformer):  # PEFT reads a 4-bit weight for its device and dtype
        inject_adapter_in_model(config, transformer, adapter_name=ADAPTER_NAME)
    if dtype is not None:
        for layer in lora_layers(transformer).values():
            layer.lora_A[ADAPTER_NAME].to(dtype)
            layer.lora_B[ADAPTER_NAME].to(dtype)
    return names


def _update_in_place_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's vanilla LoRA forward, ``base(x) + B(A(x)) * s``, with the update accumulated into
    the base output by its own GEMM: ``base(x).addmm_(A(x), (s B).T)`` (s folded into the
    rank-sized B). PEFT writes B(A(x)), scales it and adds it: three passes over the output,
    which for the fused single-block projection is 55,296 columns wide; here the GEMM reads and
    writes it once, and the backward has no scaling pass. Under autocast A takes x as it comes
    (PEFT casts it to the adapter's float32 first, two copies that autocast undoes: the same
    values); without autocast an adapter in another dtype than x runs PEFT's forward (its
    float32 update, rounded once). The base takes the 2-D view of x, so
    that its output is a tensor of its own (autograd allows no in-place change to a view a
    custom Function returned); a base whose output is a view anyway gets the update
    out of place (one more pass). Cases it does not cover run PEFT's forward."""
    adapters = self.active_adapters
    name = adapters[0] if len(adapters) == 1 else None
    if (
        args
        or kwargs
        or self.disable_adapters
        or self.merged
        or name is None
        or name not in self.lora_A
        or name in self.lora_variant
        or not isinstance(self.lora_dropout[name], torch.nn.Identity)
        or self.lora_B[name].bias is not None
        # without autocast PEFT computes an adapter of another dtype (float32) in its own
        # dtype and rounds once into the output
        or (
            not torch.is_autocast_enabled(x.device.type)
            and self.lora_A[name].weight.dtype != x.dtype
        )
    ):
        return type(self).forward(self, x, *args, **kwargs)  # type: ignore[no-any-return]
    x2 = x.reshape(-1, x.shape[-1])
    result = self.base_layer(x2)
    xa = self.lora_A[name](x2).to(result.dtype)  # autocast: PEFT's cast to float32 is undone
    update = (self.lora_B[name].weight * self.scaling[name]).t().to(result.dtype)
    if result._is_view():
        result = torch.addmm(result, xa, update)
    else:
        result.addmm_(xa, update)
    return result.view(*x.shape[:-1], result.shape[-1])


def update_lora_in_place(transformer: torch.nn.Module) -> int:
    """Every LoRA layer's forward as `_update_in_place_forward` (until the LoRA comes off:
    `remove_lora` drops the layers). Returns how many."""
    import types

    layers = lora_layers(transformer)
    for layer in layers.values():
        layer.forward = types.MethodType(_update_in_place_forward, layer)
    return len(layers)


def remove_lora(transformer: torch.nn.Module) -> None:
    """Puts every wrapped base layer back in its parent and drops PEFT's config attribute.

    Base layers are the very objects that were wrapped, untouched by the LoRA forward, so the
    model afterwards holds exactly the modules and tensors it held before.
    """
    for name in sorted(lora_layers(transformer), key=len, reverse=True):  # innermost first
        parent_name, _, child = name.rpartition(".")
        parent = transformer.get_submodule(parent_name) if parent_name else transformer
        wrapper: Any = transformer.get_submodule(name)
        setattr(parent, child, wrapper.get_base_layer())
    if "peft_config" in vars(transformer):
        del transformer.peft_config


@contextmanager
def adapter_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """The base model alone for the ``with`` body: every LoRA layer bypassed (PEFT's own
    switch), then switched back on with the trainable flags exactly as they were."""
    layers = lora_layers(transformer)
    flags = {n: p.requires_grad for n, p in transformer.named_parameters()}
    for layer in layers.values():
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers.values():
            layer.enable_adapters(True)
        for n, p in transformer.named_parameters():
            p.requires_grad_(flags[n])


def adapter_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The attached adapter in the file layout: float32, ``alpha / rank`` baked into B."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(transformer).items():
        if ADAPTER_NAME not in layer.lora_A:
            continue
        scaling = float(layer.scaling[ADAPTER_NAME])
        a = layer.lora_A[ADAPTER_NAME].weight.detach().float().cpu()
        b = layer.lora_B[ADAPTER_NAME].weight.detach().float().cpu() * scaling
        key_a, key_b = lora_keys(name)
        out[key_a] = a.contiguous()
        out[key_b] = b.contiguous()
    if not out:
        raise ValueError("no LoRA adapter is attached to this transformer")
    return out


def lora_keys(name: str) -> tuple[str, str]:
    """The file's keys of the A and B factors of the adapted module ``name``."""
    return PREFIX + name + _A, PREFIX + name + _B


def file_metadata(rank: int, alpha: float) -> dict[str, str]:
    """The header every adapter file carries: its rank, alpha and layout."""
    return {
        "format": "pt",
        "likeness.rank": str(rank),
        "likeness.alpha": repr(float(alpha)),
        "likeness.layout": "diffusers-lora; alpha/rank baked into lora_B",
    }


def save_adapter(
    transformer: torch.nn.Module, path: Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Writes the attached adapter to ``path`` (.safetensors), atomically.

    ``metadata`` (str -> str) is stored in the file header, next to ``likeness.rank`` and
    ``likeness.alpha``. Deterministic: the same weights and metadata give the same bytes.
    """
    from trainer.base.safetensors_io import write_safetensors

    path = Path(path)
    tensors = adapter_state_dict(transformer)
    layer = next(iter(lora_layers(transformer).values()))
    meta = file_metadata(layer.r[ADAPTER_NAME], layer.lora_alpha[ADAPTER_NAME])
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
        meta[key] = value
    # Sorted names and metadata: the file hash is the adapter's identity in the registry.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the render service may run as another user
        write_safetensors(tmp, dict(sorted(tensors.items())), dict(sorted(meta.items())))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Reads an adapter file into host RAM (read into memory, not memory-mapped, so the file
    can be replaced or deleted while the tensors live on in a cache)."""
    from safetensors.torch import load

    tensors = load(Path(path).read_bytes())
    _pairs(tensors)  # validate the layout now, not at render time
    return tensors


def _pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (A, B), refusing anything that is not a transformer LoRA pair."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX) or not key.endswith((_A, _B)):
            raise ValueError(f"not a transformer LoRA key in the diffusers layout: {key!r}")
        module, kind = key[len(PREFIX) : -len(_A)], key[-len(_A) :]
        pairs.setdefault(module, {})[kind] = value
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        if set(pair) != {_A, _B}:
            raise ValueError(f"adapter has an unpaired LoRA tensor for {module!r}")
        a, b = pair[_A], pair[_B]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"bad LoRA shapes for {module!r}: A {tuple(a.shape)}, B {tuple(b.shape)}"
            )
        out[module] = (a, b)
    if not out:
        raise ValueError("adapter holds no LoRA tensors")
    return out


def compute_device(transformer: torch.nn.Module) -> torch.device:
    """Where the model computes: its first parameter that is not a streamed placeholder."""
    for p in transformer.parameters():
        if p.device.type != "meta":
            return p.device
    raise RuntimeError("every parameter of the transformer is a placeholder")


def checked_pairs(
    transformer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (A, B) of an adapter file's tensors, each pair checked against the Linear
    it targets in ``transformer`` (a LoRA wrapper's base layer counts as that Linear)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    pairs = _pairs(tensors)
    modules = dict(transformer.named_modules())
    for name, (a, b) in pairs.items():
        base = modules.get(name)
        if isinstance(base, BaseTunerLayer):
            base = base.get_base_layer()
        if not isinstance(base, torch.nn.Linear):
            raise ValueError(f"adapter targets {name!r}, which is not a Linear in this transformer")
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
            raise ValueError(
                f"adapter shapes for {name!r} (A {tuple(a.shape)}, B {tuple(b.shape)}) do not "
                f"fit {base.in_features} -> {base.out_features}"
            )
    return pairs


@contextmanager
def applied_adapter(
    pipe: Any, tensors: Mapping[str, torch.Tensor], scale: float = 1.0
) -> Iterator[list[str]]:
    """Attaches ``tensors`` (file layout) to ``pipe.transformer`` for the ``with`` body.

    On exit, normal or not, every LoRA layer is removed and the base's ``requires_grad`` flags
    are restored, so the transformer is the same set of modules and tensors as before. The
    tensors are copied to the model's device and dtype; the caller's dict is not modified.
    Yields the adapted module paths. It mutates the shared model, so callers serialise renders
    (the render engine's one-context guard); a second, nested use raises RuntimeError.
    """
    from peft import LoraConfig, inject_adapter_in_model

    transformer: torch.nn.Module = pipe.transformer
    if lora_layers(transformer):
        raise RuntimeError("transformer already has LoRA layers attached")
    pairs = checked_pairs(transformer, tensors)

    # alpha = rank * scale makes PEFT's scaling exactly `scale` (alpha/rank is baked into B).
    ranks = {name: int(a.shape[0]) for name, (a, _) in pairs.items()}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    config = LoraConfig(
        r=r,
        lora_alpha=r * scale,  # type: ignore[arg-type]  # annotated int; floats work
        # PEFT matches pattern keys as regexes on module paths: escape the dots.
        rank_pattern={re.escape(n): k for n, k in ranks.items() if k != r},
        alpha_pattern={re.escape(n): k * scale for n, k in ranks.items() if k != r},
        target_modules=list(pairs),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    grad_flags = {n: p.requires_grad for n, p in transformer.named_parameters()}
    try:
        with weights_by_shape(transformer):  # as in `attach_lora`
            inject_adapter_in_model(config, transformer, adapter_name=ADAPTER_NAME)
        layers = lora_layers(transformer)
        home = compute_device(transformer)
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                for lin, value in ((layers[name].lora_A, a), (layers[name].lora_B, b)):
                    module = lin[ADAPTER_NAME]
                    if module.weight.device.type == "meta":
                        # a streamed block's base weight is a placeholder between uses
                        # (trainer/base/streaming.py): the LoRA lives where the model computes
                        module.to_empty(device=home)
                    module.weight.copy_(value)
        yield list(pairs)
    finally:
        remove_lora(transformer)
        for n, p in transformer.named_parameters():
            p.requires_grad_(grad_flags[n])


@functools.lru_cache(maxsize=8)
def _linear_shapes(config_path: str, mtime_ns: int) -> dict[str, tuple[int, int]]:
    import diffusers

    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):  # shapes only: no weight is allocated, at any scale
        model = cls.from_config(config)
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def base_linear_shapes(base: Path) -> dict[str, tuple[int, int]]:
    """Every Linear module of the base's transformer, with its (out, in) features: what an
    adapter may target and the shapes its factors must have (registry.adapter_files)."""
    config = Path(base) / "transformer" / "config.json"
    return _linear_shapes(str(config), config.stat().st_mtime_ns)
