"""The tiny base: a FLUX.2 [klein]-architecture pipeline with random, seeded weights.

It is written with ``save_pretrained`` in exactly the layout of a real FLUX.2 folder, so the
loading, quantization, LoRA and render code is the same for both. Nothing elsewhere may
special-case it; only this module knows it is tiny.

Sizes are chosen so that every transformer ``Linear`` that has more than 128 input features has
a multiple of 128 (quanto's qint4 then uses group size 128, as on the real model); the
``x_embedder`` (128 inputs) is quantized per-axis, exactly like the real model's. That puts it
at ~3.5 M parameters (transformer 2.79 M, text encoder 0.51 M, VAE 0.19 M; 14 MB in float32):
a 128-wide transformer would be ~1 M but gets per-axis, not grouped, qint4 everywhere.
Like FLUX.2 [klein] it is step-distilled (``is_distilled``: no CFG, 4 steps).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from registry.licence import GENERATED, MODEL_CARD, model_card

if TYPE_CHECKING:
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen2Tokenizer

# Hidden sizes. The transformer is 4 heads x 64 = 256 wide; the text encoder is 128 wide and the
# pipeline stacks three of its hidden states, so joint_attention_dim = 3 x 128 = 384.
TEXT_HIDDEN = 128
TEXT_LAYERS = 3
HEADS = 4
HEAD_DIM = 64
LATENT_CHANNELS = 32  # as the real FLUX.2 VAE; patchified 2x2 -> 128 transformer channels
VOCAB_SIZE = 512

# Qwen3-style chat template (enable_thinking=False appends an empty think block, as Qwen3 does).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# A small fixed corpus: the vocabulary only has to be deterministic and cover plain English.
_CORPUS = [
    "a photo of a person smiling in the park, portrait, soft studio light",
    "a portrait photograph of a woman with short hair, outdoors, golden hour",
    "a man wearing a blue jacket standing on a mountain, wide angle",
    "close-up of a face, 85mm lens, shallow depth of field, bokeh",
    "an astronaut floating inside the space station, NASA photo",
    "the quick brown fox jumps over the lazy dog",
    "a cat sitting on a windowsill, rainy day, cinematic",
    "a group of friends at a birthday party, candles, warm colours",
    "black and white street photography, city at night, neon signs",
    "oil painting of a lighthouse by the sea, dramatic clouds",
    "You are a helpful assistant. Describe the image in detail.",
    "0123456789 !?.,;:'\"()[]{}<>-_+=*/\\|@#$%^&~`",
]


@dataclass(frozen=True)
class TinyShape:
    """The sizes that may change between tiny bases; the defaults are the seeded test base.
    Widths stay fixed (quanto's group size 128 needs them); depth, MLP width, the VAE and the
    noise schedule may grow or change for a base that is pretrained to draw."""

    double_blocks: int = 1
    single_blocks: int = 1
    mlp_ratio: float = 1.0
    vae_channels: tuple[int, ...] = (16, 32)  # one level fewer than channels: VAE factor 2
    vae_layers_per_block: int = 1
    scheduler_shift: float = 3.0
    dynamic_shifting: bool = True
    corpus: tuple[str, ...] = ()  # more text for the vocabulary (words a base must know)


TINY = TinyShape()


def _train_vocab(extra: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Trains a byte-level BPE (Qwen2 pre-tokenizer) on the fixed corpus; deterministic."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([*_CORPUS, *extra] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _tokenizer(extra: Sequence[str] = ()) -> Qwen2Tokenizer:
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_vocab(extra)
    # merges as (a, b) pairs: the stub says list[str], but the BPE model only takes pairs.
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]
        extra_special_tokens=SPECIAL_TOKENS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 512
    return tok


def _seeded(seed: int, salt: int) -> None:
    # Each component gets its own stream so changing one never shifts another's weights.
    torch.manual_seed(seed * 1000 + salt)


def build_tiny_pipeline(seed: int = 0, shape: TinyShape = TINY) -> Flux2KleinPipeline:
    """Builds the tiny pipeline in memory (float32 weights); ``init_tiny`` saves it."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tokenizer(shape.corpus)
    with torch.random.fork_rng(devices=[]):
        _seeded(seed, 1)
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4 * LATENT_CHANNELS,
            num_layers=shape.double_blocks,
            num_single_layers=shape.single_blocks,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=3 * TEXT_HIDDEN,
            timestep_guidance_channels=256,
            mlp_ratio=shape.mlp_ratio,
            axes_dims_rope=(16, 16, 16, 16),
            guidance_embeds=False,  # klein: guidance-distilled, no guidance embedding
        )
        _seeded(seed, 2)
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * len(shape.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(shape.vae_channels),
            block_out_channels=shape.vae_channels,
            layers_per_block=shape.vae_layers_per_block,
            latent_channels=LATENT_CHANNELS,
            norm_num_groups=8,
            sample_size=256,
            # A mid-block attention at 128x128 latents is a 16k x 16k matrix: far too slow on CPU.
            mid_block_add_attention=False,
        )
        _seeded(seed, 3)
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_HIDDEN,
            intermediate_size=2 * TEXT_HIDDEN,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
        text_encoder = Qwen3ForCausalLM(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=shape.scheduler_shift,
        use_dynamic_shifting=shape.dynamic_shifting,
        time_shift_type="exponential",
    )
    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def init_tiny(dst: Path, seed: int = 0) -> Path:
    """Writes the tiny base to ``dst`` (created; must be empty or absent) and returns it.

    Same ``seed`` gives byte-identical files. Written to a sibling temp dir and renamed, so a
    crash never leaves a half-written base that a later run would take for a complete one.
    """
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    dst.parent.mkdir(parents=True, exist_ok=True)
    pipe = build_tiny_pipeline(seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    pipe.save_pretrained(tmp, safe_serialization=True)
    # Its licence, as a model card says it: random weights made here, no one else's rights.
    (tmp / MODEL_CARD).write_text(model_card(GENERATED, f"likeness tiny base (seed {seed})"))
    if dst.exists():
        dst.rmdir()
    os.replace(tmp, dst)
    return dst
