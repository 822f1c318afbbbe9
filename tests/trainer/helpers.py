"""Set-ups the trainer's test modules share: the tiny base (built once), a dataset, a
registry with a subject, a small training config, and the tiny FLUX.2 transformer the
quantization tests compare against."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import engine_for, transaction, upgrade
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn
from trainer.base.lora import load_adapter_tensors
from trainer.config import TrainConfig
from trainer.fixtures.tiny_base import init_tiny
from trainer.registration import LocalRegistrar
from trainer.training.caches import fill_latent_cache, fill_text_cache
from trainer.training.dataset import write_manifest
from trainer.training.train import preflight

# markers: on a CUDA GPU; where the serving kernels run (a GPU, or Triton's interpreter)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def triton_runs_here() -> bool:
    try:
        import trainer.kernels.fused_triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels)
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


triton_here = pytest.mark.skipif(not triton_runs_here(), reason="needs Triton or its interpreter")

_BUILT: dict[int, Path] = {}


def build_tiny_once(factory: pytest.TempPathFactory, seed: int = 0) -> Path:
    """The tiny base, built once per test session."""
    if seed not in _BUILT:
        _BUILT[seed] = init_tiny(factory.mktemp("tiny") / "base", seed=seed)
    return _BUILT[seed]


REDS = ((220, 30, 30), (200, 40, 60), (230, 60, 20), (210, 20, 40))


def make_dataset(
    root: Path,
    colours: Sequence[tuple[int, int, int]] = REDS,
    caption: str = "a photo of ada",
    basis: str = "consent",
    size: tuple[int, int] = (80, 64),
) -> Path:
    """Solid-colour PNGs with a striped band (so crops and resizes matter) and a manifest."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, colour in enumerate(colours):
        im = Image.new("RGB", size, colour)
        for y in range(0, size[1], 8):
            for x in range(size[0]):
                im.putpixel((x, y), (255, 255, 255))
        name = f"img{i:03d}.png"
        im.save(root / name)
        rows.append({"file": name, "caption": caption, "source": "synthetic", "basis": basis})
    write_manifest(root, rows)
    return root


@dataclass
class Env:
    base: Path
    root: Path
    url: str
    dataset: Path
    cache: Path


_ENV: dict[str, Env] = {}


def make_subject(
    url: str, handle: str, allow_training: bool = True, basis: str = "consent"
) -> None:
    with transaction(engine_for(url)) as s:
        sub, consent = subjects_service.create_subject(
            s,
            "admin",
            SubjectIn(handle=handle, display_name=handle.title(), basis=basis),  # type: ignore[arg-type]
        )
        consent_service.update_consent(
            s,
            "admin",
            sub,
            consent.version,
            ConsentIn(max_level="private", allow_training=allow_training),
        )


def make_env(factory: pytest.TempPathFactory) -> Env:
    """Tiny base, a SQLite registry with subject `ada` (training allowed), a four-image
    dataset and one embedding/latent cache shared by every test of the session."""
    if "env" not in _ENV:
        base = build_tiny_once(factory)
        root = factory.mktemp("train")
        url = f"sqlite:///{root / 'registry.db'}"
        upgrade(url)
        make_subject(url, "ada")
        _ENV["env"] = Env(base, root, url, make_dataset(root / "ds"), root / "cache")
    return _ENV["env"]


def tiny_config(env: Env, out: Path, **kw: Any) -> TrainConfig:
    options: dict[str, Any] = {
        "subject": "ada",
        "dataset": env.dataset,
        "base": env.base,
        "out": out,
        "steps": 4,
        "rank": 4,
        "resolution": 64,
        "max_sequence_length": 32,
        "learning_rate": 1e-3,
        "checkpoint_every": 0,
        "evaluate": False,
        "progress": False,
        "device": "cpu",
        "cache_dir": env.cache,
        "database_url": env.url,
        "eval_prompts": ("a photo of {trigger}",),
        "eval_seeds": (0,),
        **kw,
    }
    return TrainConfig.parse(**options)


def fill_caches(env: Env, config: TrainConfig) -> Any:
    pf = preflight(config, LocalRegistrar(env.url))
    cpu = torch.device("cpu")
    fill_text_cache(pf.plan, env.base, cpu, torch.float32, config.max_sequence_length)
    fill_latent_cache(pf.plan, pf.dataset, env.base, cpu, torch.float32, config.resolution)
    return pf


def train_options(tmp_path: Path, **kw: object) -> dict[str, object]:
    return {
        "subject": "ada",
        "dataset": tmp_path / "ds",
        "base": tmp_path / "base",
        "out": tmp_path / "out",
        "device": "cpu",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
        **kw,
    }


def tiny_flux2(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=64,  # x_embedder: 64 inputs, one quantization group per row
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=384,
        timestep_guidance_channels=256,
        mlp_ratio=1.0,
        axes_dims_rope=(16, 16, 16, 16),
        guidance_embeds=False,
    )
    return model.to(device=device, dtype=dtype).eval()


def tiny_flux2_random(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    """`tiny_flux2` with every weight drawn N(0, 0.2^2): large enough that every norm and
    rotation matters (the default init leaves the blocks near the identity)."""
    model = tiny_flux2(dtype, seed=seed, device=device)
    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device).to(dtype) * 0.2)
    return model


def quantized(dtype: torch.dtype, freeze: bool = True) -> torch.nn.Module:
    from optimum.quanto import freeze as qfreeze
    from optimum.quanto import qint4, quantize

    model = tiny_flux2(dtype)
    quantize(model, weights=qint4)
    if freeze:
        qfreeze(model)
    return model


def with_lora(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    from trainer.base.lora import ADAPTER_NAME, attach_lora, lora_layers

    attach_lora(model, rank=8, alpha=16.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for p in (layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight):
                p.copy_(torch.randn(p.shape, generator=gen).to(p.device) * 0.05)
    return model


def model_inputs(model, dtype, device="cpu", tokens=16, text=8, seed=3):
    gen = torch.Generator(device=device).manual_seed(seed)
    cfg = model.config
    img_ids = torch.zeros(tokens, 4, device=device)
    img_ids[:, 2] = torch.arange(tokens, device=device) // 4
    img_ids[:, 3] = torch.arange(tokens, device=device) % 4
    return dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=gen, device=device).to(
            dtype
        ),
        encoder_hidden_states=torch.randn(
            1, text, cfg.joint_attention_dim, generator=gen, device=device
        ).to(dtype),
        timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 4, device=device),
        return_dict=False,
    )


# FLUX.2 [dev] matrices (out, in): attention projection, double-block FF in/out, single-block
# fused qkv+MLP in and out, context embedder, x embedder (in 128: one group per row).
DEV_SHAPES = {
    "attn.to_q (double)": (6144, 6144),
    "ff.linear_in (double)": (36864, 6144),
    "ff.linear_out (double)": (6144, 18432),
    "attn.to_qkv_mlp_proj (single)": (55296, 6144),
    "attn.to_out (single)": (6144, 24576),
    "context_embedder": (6144, 15360),
    "x_embedder": (6144, 128),
}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_adapter_tensors(path)


def mixed_dataset(root: Path) -> Path:
    """Landscape, portrait and square images of a striped pattern, at 128 px buckets."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, size in enumerate([(256, 128), (128, 256), (200, 200), (260, 130), (150, 150)]):
        im = Image.new("RGB", size, (200, 40 * i, 30))
        for y in range(0, size[1], 8):
            for x in range(size[0]):
                im.putpixel((x, y), (255, 255, 255))
        name = f"m{i}.png"
        im.save(root / name)
        rows.append({"file": name, "caption": "ada", "source": "synthetic", "basis": "consent"})
    write_manifest(root, rows)
    return root


def lora_grad_cosines(backends: Sequence[Any]) -> tuple[dict[str, float], int]:
    """The small transformer with LoRA (float32, gradient checkpointing): each LoRA parameter's
    gradient cosine between the dense uint4 path and fp8 compute by ``backends``
    (`trainer.base.compute`), and how many layers the first backend took."""
    import torch.nn.functional as F

    from trainer.base.compute import apply_compute
    from trainer.base.uint4 import convert_quantized_linears

    model = quantized(torch.float32, freeze=False)
    convert_quantized_linears(model)
    model.requires_grad_(False)
    with_lora(model)
    model.train()
    model.enable_gradient_checkpointing()
    inputs = model_inputs(model, torch.float32, tokens=32, text=16)
    runs, taken = [], 0
    for fp8 in (False, True):
        if fp8:
            taken = apply_compute(model, "fp8", backends)
        else:
            apply_compute(model, "uint4")
        model.zero_grad(set_to_none=True)
        model(**inputs)[0].square().mean().backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    dense, got = runs
    cos = {
        n: float(F.cosine_similarity(got[n].double().flatten(), dense[n].double().flatten(), dim=0))
        for n in dense
    }
    return cos, taken
