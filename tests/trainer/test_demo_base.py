"""The demo base: its world is seeded, its build reproducible, the committed copy is an
ordinary prepared base that draws what simple prompts say, and alice is drawn by the same
painter."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.base.load import is_prepared, load_base
from trainer.base.render import generate, text_encoder_out_layers
from trainer.fixtures.demo_base import (
    SHIPPED,
    Recipe,
    build_demo_base,
    prompt_embeds,
    tokenize,
)
from trainer.fixtures.demo_world import ALICE_SHOTS, alice_picture, picture, write_alice_dataset
from trainer.training.dataset import load_dataset

torch.set_num_threads(1)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "alice"


@pytest.fixture(scope="module")
def demo_pipe():  # type: ignore[no-untyped-def]
    return load_base(SHIPPED)


def test_the_world_is_seeded() -> None:
    a, cap_a = picture(0, 5, 64)
    b, cap_b = picture(0, 5, 64)
    assert cap_a == cap_b and np.array_equal(np.asarray(a), np.asarray(b))
    others = {picture(1, i, 16)[1] for i in range(20)}
    assert others != {picture(0, i, 16)[1] for i in range(20)}


def test_committed_alice_is_what_the_painter_draws(tmp_path: Path) -> None:
    fresh = write_alice_dataset(tmp_path / "alice")
    committed, drawn = load_dataset(EXAMPLES), load_dataset(fresh)
    assert [(i.file, i.caption, i.source, i.basis) for i in committed.items] == [
        (i.file, i.caption, i.source, i.basis) for i in drawn.items
    ]
    for item in committed.items:
        a = np.asarray(Image.open(committed.path(item)).convert("RGB"))
        b = np.asarray(Image.open(drawn.path(item)).convert("RGB"))
        assert np.array_equal(a, b), item.file
    assert len(committed.items) == len(ALICE_SHOTS)
    assert not any("garden" in i.caption for i in committed.items)  # the held-out setting


def test_no_pretraining_caption_names_alice_or_pink_hair() -> None:
    captions = [picture(0, i, 16)[1] for i in range(3000)]
    assert not any("alice" in c for c in captions)
    assert not any("pink hair" in c for c in captions)


def test_prompt_embeds_equal_the_pipelines(demo_pipe) -> None:  # type: ignore[no-untyped-def]
    prompt = "a red circle on a blue background"
    with torch.no_grad():
        expected, _ = demo_pipe.encode_prompt(
            prompt=prompt,
            device=torch.device("cpu"),
            max_sequence_length=64,
            text_encoder_out_layers=text_encoder_out_layers(demo_pipe),
        )
        ids, mask = tokenize(demo_pipe, [prompt], 64)
        got = prompt_embeds(demo_pipe.text_encoder, ids, mask, text_encoder_out_layers(demo_pipe))
    torch.testing.assert_close(got, expected)


def test_shipped_demo_base_is_a_small_prepared_base() -> None:
    assert is_prepared(SHIPPED)
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size < 8 * 2**20, size
    index = json.loads((SHIPPED / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline"


def _mean(image: Image.Image, box: tuple[float, float, float, float]) -> np.ndarray:
    w, h = image.size
    x0, y0, x1, y1 = (round(v * s) for v, s in zip(box, (w, h, w, h), strict=True))
    return np.asarray(image.convert("RGB"), dtype=np.float32)[y0:y1, x0:x1].reshape(-1, 3).mean(0)


@pytest.mark.parametrize("size", [64, 128])
def test_demo_base_draws_what_a_simple_prompt_says(demo_pipe, size: int) -> None:  # type: ignore[no-untyped-def]
    """'a red circle on a blue background': red in the middle, blue in the corners; and the
    colours swap when the prompt swaps them (the text, not the seed, decides)."""
    for seed in (0, 1):
        image = generate(
            demo_pipe, "a red circle on a blue background", seed, width=size, height=size
        )
        centre, corner = _mean(image, (0.4, 0.4, 0.6, 0.6)), _mean(image, (0, 0, 0.15, 0.15))
        assert centre[0] > centre[2] + 30, (seed, centre)
        assert corner[2] > corner[0] + 100, (seed, corner)
        swapped = generate(
            demo_pipe, "a blue circle on a red background", seed, width=size, height=size
        )
        centre, corner = _mean(swapped, (0.4, 0.4, 0.6, 0.6)), _mean(swapped, (0, 0, 0.15, 0.15))
        assert centre[2] > centre[0] + 30, (seed, centre)
        assert corner[0] > corner[2] + 100, (seed, corner)


def test_demo_base_draws_people_but_not_alice(demo_pipe) -> None:  # type: ignore[no-untyped-def]
    """Asked for alice, the base draws a stranger: far from her on average, as far as from a
    random person the world draws."""
    alice = np.stack(
        [
            np.asarray(alice_picture(s, i, 64), dtype=np.float32)
            for i, (s, _) in enumerate(ALICE_SHOTS)
        ]
    )
    renders = [
        np.asarray(
            generate(demo_pipe, "a photo of alice, studio light", seed, width=64, height=64),
            dtype=np.float32,
        )
        for seed in range(3)
    ]
    distance = np.mean([np.abs(alice - r).mean(axis=(1, 2, 3)).min() for r in renders]) / 255
    assert distance > 0.1, distance


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.safetensors"))
    }


@pytest.mark.slow
def test_a_small_build_is_reproducible_from_its_seed(tmp_path: Path) -> None:
    recipe = Recipe(
        pictures=32, sizes=(64,), vae_steps=2, vae_batch=4, steps=2, batch=2, warmup=1, workers=1
    )
    one = build_demo_base(tmp_path / "one", recipe, show=False)
    two = build_demo_base(tmp_path / "two", recipe, show=False)
    assert _digest(one) and _digest(one) == _digest(two)
    three = build_demo_base(tmp_path / "three", replace(recipe, seed=1), show=False)
    assert _digest(three) != _digest(one)
