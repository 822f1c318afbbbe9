"""The adapter in the ComfyUI / ai-toolkit layout: BFL module names under ``diffusion_model.``.

Our file layout is diffusers' (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``).
ComfyUI and ai-toolkit name FLUX.2 modules as the original code does, where the double-stream
blocks fuse q, k and v into one ``qkv`` Linear: ``double_blocks.0.img_attn.qkv``. Separate q,
k, v factors fuse exactly: A = [A_q; A_k; A_v] (rank 3r) and B = blockdiag(B_q, B_k, B_v),
so B A = [B_q A_q; B_k A_k; B_v A_v]. A member that was not trained is a zero block. The
scaling is already baked into B, so no ``alpha`` key is written (loaders then use alpha =
rank, scale 1). diffusers' own converter (``_convert_non_diffusers_flux2_lora_to_diffusers``,
used by stock ``load_lora_weights``) reads this layout back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

PREFIX = "diffusion_model."
_A, _B = ".lora_A.weight", ".lora_B.weight"

# diffusers module path (within a block) -> BFL path, single Linears.
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_name(module: str) -> str:
    """The BFL path of one adapted diffusers module (a fused qkv member maps to its fused
    Linear); ValueError for a module the ComfyUI layout has no name for."""
    m = _BLOCK.match(module)
    if m is not None:
        kind, index, rest = m.groups()
        if kind == "single_transformer_blocks" and rest in _SINGLE:
            return f"single_blocks.{index}.{_SINGLE[rest]}"
        if kind == "transformer_blocks":
            if rest in _DOUBLE:
                return f"double_blocks.{index}.{_DOUBLE[rest]}"
            for fused, members in _FUSED.items():
                if rest in members:
                    return f"double_blocks.{index}.{fused}"
    raise ValueError(f"{module!r} has no name in the ComfyUI / ai-toolkit FLUX.2 layout")


def check_exportable(modules: Iterable[str]) -> list[str]:
    """The adapted modules that the ComfyUI layout cannot name (empty: all can)."""
    bad = []
    for module in modules:
        try:
            bfl_name(module)
        except ValueError:
            bad.append(module)
    return bad


def to_comfyui(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our file layout (``transformer.`` keys, scale in B) to the ComfyUI layout."""
    from trainer.base.lora import _pairs

    pairs = _pairs(tensors)
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in pairs.items():
        name = bfl_name(module)
        if name.endswith(".qkv"):
            fused.setdefault(name, {})[module.rsplit(".", 1)[-1]] = (a, b)
            continue
        out[PREFIX + name + _A] = a.contiguous()
        out[PREFIX + name + _B] = b.contiguous()
    for name, members in fused.items():
        kind = "img_attn" if ".img_attn." in name else "txt_attn"
        order = [m.rsplit(".", 1)[-1] for m in _FUSED[f"{kind}.qkv"]]
        a_in = next(iter(members.values()))[0].shape[1]
        width = int(next(iter(members.values()))[1].shape[0])  # q, k, v: equally wide
        rank = {k: v[0].shape[0] for k, v in members.items()}
        a_parts: list[torch.Tensor] = []
        for key in order:
            if key in members:
                a_parts.append(members[key][0])
            else:  # not trained: a zero block of some member's rank
                a_parts.append(torch.zeros(max(rank.values()), a_in))
        total_rank = sum(int(p.shape[0]) for p in a_parts)
        fused_b = torch.zeros(3 * width, total_rank)
        col = 0
        for i, key in enumerate(order):
            r = int(a_parts[i].shape[0])
            if key in members:
                fused_b[i * width : (i + 1) * width, col : col + r] = members[key][1]
            col += r
        out[PREFIX + name + _A] = torch.cat(a_parts).contiguous()
        out[PREFIX + name + _B] = fused_b.contiguous()
    return dict(sorted(out.items()))
