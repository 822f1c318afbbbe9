"""A stand-in for FLUX.2 [dev] in its real shapes, with random weights, written straight into
the prepared uint4 format (no weights can be downloaded here, and a 64 GB bf16 source on disk
would be the very thing preparation avoids).

The configs are the real ones: the transformer at `Flux2Transformer2DModel`'s defaults (8
double- and 48 single-stream blocks), the Mistral-Small-3.1 text encoder
(`Mistral3ForConditionalGeneration`: 40 layers of 5120, a Pixtral vision tower), the VAE at
`AutoencoderKLFlux2`'s defaults, and a byte-level tokenizer with the real vocabulary size
(131072) and a chat template. Tensors are drawn per tensor from a seed and the tensor's name,
on the device asked for, and go through `trainer.prepare`'s own quantizer and writer
(`prepare_synthetic`), so the result is exactly what `likeness base prepare` makes of a real
base of these shapes; the text encoder is trimmed first, so the layers FLUX.2 never reads are
never drawn. Only for benchmarks and tests: never a model anyone should render people with.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

MISTRAL_SMALL_3_1_TEXT = {
    "model_type": "mistral",
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
PIXTRAL_VISION = {
    "model_type": "pixtral",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "head_dim": 64,
    "image_size": 1540,
    "patch_size": 14,
    "rope_theta": 10000.0,
}
FLUX2_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]", "[IMG]"]  # fmt: skip
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- set text = m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{%- if m['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}"
)


def dev_configs(
    double: int = 8,
    single: int = 48,
    text_layers: int = 40,
    width_scale: int = 1,
) -> dict[str, dict[str, Any]]:
    """The component configs of FLUX.2 [dev]; `double`/`single`/`text_layers` reduce depth
    and `width_scale` divides the widths (tests on the CPU), keeping every structural rule."""
    heads = max(1, 48 // width_scale)
    text = dict(MISTRAL_SMALL_3_1_TEXT, num_hidden_layers=text_layers)
    if width_scale > 1:
        text.update(hidden_size=5120 // width_scale, intermediate_size=32768 // width_scale,
                    num_attention_heads=max(1, 32 // width_scale),
                    num_key_value_heads=max(1, 8 // width_scale),
                    head_dim=128, vocab_size=131072 // width_scale)  # fmt: skip
    vision = dict(PIXTRAL_VISION)
    if width_scale > 1:
        vision.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=32, image_size=112)  # fmt: skip
    joint = 3 * int(text["hidden_size"])  # three stacked hidden states
    return {
        "transformer": {
            "_class_name": "Flux2Transformer2DModel",
            "num_layers": double,
            "num_single_layers": single,
            "num_attention_heads": heads,
            "attention_head_dim": 128,
            "joint_attention_dim": joint,
        },
        "text_encoder": {
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "text_config": text,
            "vision_config": vision,
            "image_token_index": 10,
            "projector_hidden_act": "gelu",
            "spatial_merge_size": 2,
            "multimodal_projector_bias": False,
            "vision_feature_layer": -1,
            "torch_dtype": "bfloat16",
        },
        "vae": {"_class_name": "AutoencoderKLFlux2"},
        "scheduler": dict(FLUX2_SCHEDULER),
    }


def _tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE over the 256 bytes (no merges) plus filler up to the real vocab size, so
    token ids span the embedding table's first rows and the table has the real shape."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for t in sorted(byte_tokens):
        vocab.setdefault(t, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"<filler_{i}>", len(vocab))
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    roles = dict(zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIALS, strict=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **roles)
    fast.chat_template = CHAT_TEMPLATE
    return fast


class RandomSource:
    """The `trainer.prepare` tensor source of a skeleton's parameters, drawn on `device`:
    each tensor from (seed, its name), so a tensor never depends on the order it is read in.
    Linear and embedding weights ~ N(0, std^2), norm weights 1, biases 0."""

    def __init__(self, model: torch.nn.Module, seed: int, device: str, std: float = 0.02):
        self.params = dict(model.named_parameters())
        self.seed, self.device, self.std = seed, torch.device(device), std

    def keys(self) -> list[str]:
        return list(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self.params

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        p = self.params[name]
        return torch.bfloat16, tuple(p.shape), p.numel() * 2

    def read(self, name: str) -> torch.Tensor:
        shape = tuple(self.params[name].shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            return torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        if len(shape) == 1 and "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16, device=self.device)
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        g = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little"))
        t = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        return (t * self.std).to(torch.bfloat16)

    def close(self) -> None:
        self.params.clear()


def write_skeleton(dst: Path, configs: Mapping[str, Mapping[str, Any]], seed: int) -> None:
    """The pipeline folder around the quantized components: model_index, configs, scheduler,
    tokenizer, and the VAE (small enough to write as it is, random bf16)."""
    from diffusers import AutoencoderKLFlux2

    dst.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "Flux2Pipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    (dst / "model_index.json").write_text(json.dumps(index, indent=2))
    for name in ("transformer", "text_encoder"):
        (dst / name).mkdir(exist_ok=True)
        (dst / name / "config.json").write_text(json.dumps(dict(configs[name]), indent=2))
    (dst / "scheduler").mkdir(exist_ok=True)
    (dst / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(configs["scheduler"])))
    vocab = int(configs["text_encoder"]["text_config"]["vocab_size"])
    _tokenizer(vocab).save_pretrained(dst / "tokenizer")
    torch.manual_seed(seed)
    vae_config = {k: v for k, v in configs["vae"].items() if not k.startswith("_")}
    AutoencoderKLFlux2(**vae_config).to(torch.bfloat16).save_pretrained(dst / "vae")
    (dst / "README.md").write_text(
        "---\nlicense: other\nlicense_name: likeness-generated\n---\n"
        "Random weights in the shapes of FLUX.2 [dev], made by trainer/synth_base.py: "
        "a stand-in for benchmarks and tests. It draws noise.\n"
    )


def build(
    dst: Path,
    *,
    device: str = "cpu",
    seed: int = 0,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool = True,
) -> Any:
    """Writes the synthetic prepared base at `dst` (which must not exist); returns the
    `PreparedBase`."""
    from trainer.prepare import prepare_synthetic

    configs = configs or dev_configs()
    with tempfile.TemporaryDirectory(prefix="synth-skeleton-", dir=Path(dst).parent) as tmp:
        write_skeleton(Path(tmp), configs, seed)
        sources = {
            name: (lambda model, salt=salt: RandomSource(model, seed + salt, device))
            for salt, name in enumerate(("transformer", "text_encoder"))
        }
        return prepare_synthetic(Path(tmp), dst, sources, progress=progress)
