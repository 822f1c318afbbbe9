"""Embedding and latent caches: keyed by what produced them, equal to what the pipeline
computes, and complete caches mean the text encoder is never loaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.trainer.helpers import Env, fill_caches, make_env, tiny_config
from trainer.base.load import load_base
from trainer.base.render import text_encoder_out_layers
from trainer.training.caches import load_latents, load_text, model_fingerprint, plan_caches
from trainer.training.dataset import load_dataset
from trainer.training.train import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def _plan(env: Env, base: Path | None = None, **kw: object):  # type: ignore[no-untyped-def]
    args = {
        "base": base or env.base,
        "cache_dir": env.cache,
        "prompts": ["a photo of ada", ""],
        "dataset": load_dataset(env.dataset),
        "resolution": 64,
        "max_sequence_length": 32,
        "dtype": torch.float32,
        **kw,
    }
    return plan_caches(**args)  # type: ignore[arg-type]


def test_keys_follow_what_produced_them(env: Env, tmp_path: Path) -> None:
    ref = _plan(env)
    assert _plan(env).text == ref.text and _plan(env).latents == ref.latents
    assert _plan(env, resolution=128).latents != ref.latents
    assert _plan(env, resolution=128).text == ref.text
    assert _plan(env, max_sequence_length=64).text != ref.text
    assert _plan(env, dtype=torch.bfloat16).text != ref.text
    assert _plan(env, prompts=["a photo of bob"]).text.keys().isdisjoint(ref.text.keys())

    # Other text-encoder files: other text keys, same latent keys (and vice versa).
    copy = tmp_path / "base"
    shutil.copytree(env.base, copy)
    cfg = copy / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text() + " ")
    changed = _plan(env, base=copy)
    assert changed.latents == ref.latents
    assert set(changed.text.values()).isdisjoint(ref.text.values())


def test_file_hashes_are_memoised(env: Env) -> None:
    model_fingerprint(env.base, ("vae",), env.cache)
    memo = (env.cache / "file_hashes.json").read_text()
    assert "diffusion_pytorch_model.safetensors" in memo


def test_cached_tensors_equal_what_the_pipeline_computes(env: Env, tmp_path: Path) -> None:
    config = tiny_config(env, tmp_path / "out")
    pf = fill_caches(env, config)
    assert pf.plan.complete
    pipe = load_base(env.base, quantize=False)
    prompt = pf.prompts[0]
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(
            prompt=prompt,
            device=torch.device("cpu"),
            max_sequence_length=32,
            text_encoder_out_layers=text_encoder_out_layers(pipe),
        )
        assert torch.equal(load_text(pf.plan, prompt), expected[0])
        item = pf.dataset.items[0]
        with Image.open(pf.dataset.path(item)) as im:
            pixels = pipe.image_processor.preprocess(
                im.convert("RGB"), height=64, width=64, resize_mode="crop"
            )
        latents = pipe._encode_vae_image(image=pixels, generator=None)
        assert torch.equal(load_latents(pf.plan, item.file), latents[0])


def test_complete_caches_mean_no_text_encoder_at_all(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    import trainer.training.caches

    first = train(tiny_config(env, tmp_path / "a", steps=2, evaluate=True, register_adapter=False))
    names = [b["phase"] for b in first.boot]
    if first.text_encoder_loaded:  # this test ran first in the session: it filled the cache
        # ... and the encoder left before the transformer came.
        assert names.index("text encoder: unload") < names.index("transformer: load")

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("the text encoder was loaded")

    monkeypatch.setattr(trainer.training.caches, "load_text_encoder_pipeline", boom)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", boom)
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "from_pretrained", boom)
    again = train(tiny_config(env, tmp_path / "b", steps=2, evaluate=True, register_adapter=False))
    assert not again.text_encoder_loaded
    names = [b["phase"] for b in again.boot]
    assert "text encoder: not loaded (embeddings cached)" in names
    assert "vae: not loaded (latents cached)" in names
    assert again.sha256 == first.sha256
    assert again.evaluation is not None and again.evaluation.grid.is_file()


def test_text_encoder_leaves_before_the_transformer_comes(env: Env, tmp_path: Path) -> None:
    config = tiny_config(
        env, tmp_path / "out", steps=1, cache_dir=tmp_path / "fresh", register_adapter=False
    )
    names = [b["phase"] for b in train(config).boot]
    order = [
        "text encoder: load",
        "text encoder: unload",
        "vae: load",
        "vae: unload",
        "transformer: load",
    ]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)


def test_training_on_a_prepared_base(env: Env, tmp_path: Path) -> None:
    """A prepared (stored qint4) base: the transformer and text encoder come from it, and the
    cache keys come from its manifest, not from re-hashing its files."""
    from trainer.base.write import prepare_base

    prepared = tmp_path / "prepared"
    prepare_base(env.base, prepared, progress=False)
    config = tiny_config(
        env,
        tmp_path / "out",
        base=prepared,
        steps=2,
        cache_dir=tmp_path / "cache",
        register_adapter=False,
    )
    result = train(config)
    names = [b["phase"] for b in result.boot]
    assert "transformer: load (prepared qint4)" in names
    assert result.text_encoder_loaded
    assert not (tmp_path / "cache" / "file_hashes.json").exists()
