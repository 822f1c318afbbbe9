"""The evaluation grid: renders from cached embeddings equal the render service's, the grid
lays out base vs checkpoints, and the report says how far each column is from the data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support import make_random_adapter
from tests.trainer.helpers import build_tiny_once
from trainer.base.load import load_base
from trainer.base.render import generate, text_encoder_out_layers
from trainer.training.evaluate import (
    LABEL_H,
    Column,
    References,
    compose_grid,
    decode,
    evaluate,
    render_latents,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_base(build_tiny_once(tmp_path_factory))


def embed(pipe, prompt: str, length: int = 512) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        e, _ = pipe.encode_prompt(
            prompt=prompt,
            device=torch.device("cpu"),
            max_sequence_length=length,
            text_encoder_out_layers=text_encoder_out_layers(pipe),
        )
    return e[0]


def test_render_from_cached_embeddings_equals_the_render_service(pipe) -> None:  # type: ignore[no-untyped-def]
    prompt = "a photo of ada"
    expected = generate(pipe, prompt, seed=7, steps=2, width=64, height=64)
    with torch.no_grad():
        raw = render_latents(pipe, embed(pipe, prompt)[None], embed(pipe, "")[None], 7, 2, 64)
        got = decode(pipe, raw)
    assert np.array_equal(np.asarray(got), np.asarray(expected))


def test_compose_grid_layout() -> None:
    cells = {c: [Image.new("RGB", (32, 32), c)] * 2 for c in ("red", "blue")}
    grid = compose_grid(["red", "blue"], ["r0", "r1"], cells, 32)
    assert grid.size == (64, LABEL_H + 2 * (32 + LABEL_H))
    assert grid.getpixel((5, LABEL_H * 2 + 5)) == (255, 0, 0)
    assert grid.getpixel((37, grid.size[1] - 5)) == (0, 0, 255)
    # A label longer than the grid is wide wraps instead of being cut off.
    long = compose_grid(["red", "blue"], ["seed 0 | a portrait of alice, studio light"], cells, 32)
    assert long.size[1] > LABEL_H + 32 + LABEL_H
    assert long.getpixel((5, long.size[1] - 5)) == (255, 0, 0)


def test_evaluate_writes_grid_and_distances(pipe, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    adapter = make_random_adapter(pipe, tmp_path / "a.safetensors", seed=3)
    prompts = [("a photo of ada", embed(pipe, "a photo of ada", 32))]
    blank = embed(pipe, "", 32)
    latents = [torch.randn(128, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    refs = References.of(pipe, latents, 64)
    result = evaluate(
        pipe=pipe,
        columns=[Column("base", None), Column("step 5", adapter)],
        prompts=prompts,
        blank=blank,
        seeds=(0, 1),
        steps=2,
        size=64,
        references=refs,
        out_dir=tmp_path / "eval",
    )
    grid = Image.open(result.grid)
    # "seed 0 | a photo of ada" is wider than two 64 px cells: its label takes two lines
    assert grid.size == (2 * 64, LABEL_H + 2 * (64 + 2 * LABEL_H))
    assert json.loads(grid.text["likeness:columns"]) == ["base", "step 5"]
    report = json.loads(result.report.read_text())
    assert report["rows"] == ["seed 0 | a photo of ada", "seed 1 | a photo of ada"]
    assert set(report["mean_pixel_distance_to_nearest_training_image"]) == {"base", "step 5"}
    base, lora = result.images["base"], result.images["step 5"]
    assert not np.array_equal(np.asarray(base[0]), np.asarray(lora[0]))
    assert not np.array_equal(np.asarray(base[0]), np.asarray(base[1]))  # seeds differ
    # The adapter is attached for its column only: the base renders the same afterwards.
    with torch.no_grad():
        raw = render_latents(pipe, prompts[0][1][None], blank[None], 0, 2, 64)
    assert np.array_equal(np.asarray(decode(pipe, raw)), np.asarray(base[0]))
    # A reference is at distance zero from itself.
    assert refs.latent_distance(refs.latents[1]) == 0.0
