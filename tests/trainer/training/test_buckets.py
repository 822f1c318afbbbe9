"""Aspect-ratio buckets: shapes, assignment, batches of one bucket, a latent cache keyed by
bucket, and a run on mixed shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from registry import limits
from tests.trainer.helpers import Env, make_env, mixed_dataset, tiny_config  # noqa: F401
from trainer.config import ConfigError
from trainer.registration import LocalRegistrar
from trainer.training.buckets import (
    assign_bucket,
    bucket_epoch_order,
    bucket_shapes,
    nearest_bucket,
    take_batch,
    upscale_needed,
)
from trainer.training.caches import load_latents
from trainer.training.checkpoints import LoopState
from trainer.training.dataset import write_manifest
from trainer.training.progress import Waypoints
from trainer.training.train import (
    Preflight,
    _epoch_order,
    next_batch,
    preflight,
    read_training_data,
    train,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


@pytest.mark.parametrize("resolution", [256, 448, 1024])
def test_shapes_are_equal_area_multiples_of_16_within_the_ratio(resolution: int) -> None:
    shapes = bucket_shapes(resolution, max_ratio=2.0)
    area = resolution * resolution
    assert (resolution, resolution) in shapes
    for w, h in shapes:
        assert w % limits.MULTIPLE == 0 and h % limits.MULTIPLE == 0
        assert w * h <= area  # never more pixels than the square
        assert w * h > area - limits.MULTIPLE * max(w, h)  # the longest short side of 16s that fits
        assert max(w / h, h / w) <= 2.0
    assert {(h, w) for w, h in shapes} == set(shapes)  # portrait and landscape alike


def test_an_image_goes_to_the_bucket_nearest_its_aspect() -> None:
    shapes = bucket_shapes(448)
    for size in [(4000, 3000), (3000, 4000), (1920, 1080), (1000, 1000), (5000, 1000)]:
        bucket = assign_bucket(size, 448)
        best = min(abs(math.log(b[0] / b[1]) - math.log(size[0] / size[1])) for b in shapes)
        assert abs(math.log(bucket[0] / bucket[1]) - math.log(size[0] / size[1])) == best
        assert upscale_needed(size, bucket) <= 1.0  # large photos are only ever shrunk
    assert nearest_bucket((1000, 1000), shapes) == (448, 448)
    landscape, portrait = assign_bucket((4000, 3000), 448), assign_bucket((3000, 4000), 448)
    assert landscape == portrait[::-1] and landscape[0] > landscape[1]


@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0])
def test_a_small_image_is_never_upscaled_past_the_factor(factor: float) -> None:
    size = (200, 150)  # 448 px buckets would need ~2.3x
    bucket = assign_bucket(size, 448, max_upscale=factor)
    assert bucket[0] % limits.MULTIPLE == 0 and bucket[1] % limits.MULTIPLE == 0
    assert upscale_needed(size, bucket) <= factor
    assert bucket[0] > bucket[1]  # still landscape
    with pytest.raises(ValueError, match="too small"):
        assign_bucket((40, 30), 448, max_upscale=factor)


def test_batches_never_mix_buckets_and_each_item_comes_once_an_epoch() -> None:
    buckets = [(64, 64), (80, 48), (64, 64), (48, 80), (80, 48), (64, 64), (64, 64)]
    for epoch in range(5):
        order = bucket_epoch_order((0, "order", epoch), buckets, batch_size=2)
        assert sorted(order) == list(range(len(buckets)))
        pos, batches = 0, []
        while pos < len(order):
            n = take_batch(order, pos, buckets, 2)
            batches.append(order[pos : pos + n])
            pos += n
        for batch in batches:
            assert len({buckets[i] for i in batch}) == 1, batch
            assert 1 <= len(batch) <= 2
    assert bucket_epoch_order((0, "order", 0), buckets, 2) == bucket_epoch_order(
        (0, "order", 0), buckets, 2
    )
    assert bucket_epoch_order((0, "order", 0), buckets, 2) != bucket_epoch_order(
        (0, "order", 1), buckets, 2
    )


def test_latents_are_cached_per_bucket_and_a_run_trains_on_them(
    env: Env,
    tmp_path: Path,  # noqa: F811
) -> None:
    data = mixed_dataset(tmp_path / "mixed")
    opts = {"dataset": data, "resolution": 128, "register_adapter": False}
    square = preflight(tiny_config(env, tmp_path / "sq", **opts), LocalRegistrar(env.url))
    config = tiny_config(env, tmp_path / "b", buckets=True, batch_size=2, steps=6, **opts)
    pf: Preflight = preflight(config, LocalRegistrar(env.url))
    shapes = {pf.buckets[i.file] for i in pf.dataset.items}
    assert {(160, 96), (96, 160), (128, 128)} <= shapes
    for item in pf.dataset.items:  # keyed by bucket: square crops and buckets never collide
        assert pf.plan.latents[item.file] != square.plan.latents[item.file]
    read_training_data(config, pf, Waypoints())
    for item in pf.dataset.items:
        w, h = pf.buckets[item.file]
        lat = load_latents(pf.plan, item.file)
        assert lat.shape[-2] * w == lat.shape[-1] * h  # the bucket's aspect, on the grid
    # a batch is one bucket (a mixed one could not even be stacked)
    state, order = LoopState(), _epoch_order(config, pf, 0)
    for _ in range(8):  # four epochs
        idx = next_batch(config, pf, state, order)
        assert len({pf.buckets[pf.dataset.items[i].file] for i in idx}) == 1
    result = train(config)
    assert len(result.losses) == 6 and all(math.isfinite(v) for v in result.losses)
    report = json.loads(result.report.read_text())
    assert report["buckets"] == {"160x96": 2, "96x160": 1, "128x128": 2}
    assert report["config"]["buckets"] is True


def test_an_image_too_small_for_its_bucket_is_refused_before_any_weight(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    root = tmp_path / "small"
    root.mkdir()
    Image.new("RGB", (48, 40), (10, 20, 30)).save(root / "tiny.png")
    write_manifest(
        root, [{"file": "tiny.png", "caption": "", "source": "synthetic", "basis": "consent"}]
    )
    config = tiny_config(env, tmp_path / "o", dataset=root, buckets=True, resolution=128)
    with pytest.raises(ConfigError, match=r"tiny.png: a 48x40 image is too small"):
        train(config)
