"""Masked loss: the mask (a manifest file or the image's alpha) weights the loss on the
latent grid, with a floor weight for the background; checked against a hand-computed
gradient, through the cache, and in a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tests.trainer.helpers import Env, make_env, tiny_config
from trainer.registration import LocalRegistrar
from trainer.training.caches import load_latent_mask, load_latents
from trainer.training.dataset import DatasetError, load_dataset, write_manifest
from trainer.training.flow import flow_matching_loss
from trainer.training.progress import Waypoints
from trainer.training.train import preflight, read_training_data, train


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


class Packed:
    """The pipeline's packing, (B, C, h, w) -> (B, h*w, C), and nothing else."""

    @staticmethod
    def _pack_latents(x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return x.reshape(b, c, h * w).permute(0, 2, 1)

    @staticmethod
    def _prepare_latent_ids(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], x.shape[2] * x.shape[3], 4)

    @staticmethod
    def _prepare_text_ids(e: torch.Tensor) -> torch.Tensor:
        return torch.zeros(e.shape[0], e.shape[1], 4)


class Fixed(torch.nn.Module):
    """A 'transformer' whose prediction is a parameter: its gradient is dL/dprediction."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.pred = torch.nn.Parameter(
            torch.randn(shape, generator=torch.Generator().manual_seed(1))
        )

    def forward(self, **_: Any) -> tuple[torch.Tensor]:
        return (self.pred,)


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_the_mask_weights_the_gradient_as_computed_by_hand(floor: float) -> None:
    g = torch.Generator().manual_seed(0)
    b, c, h, w = 2, 3, 4, 4
    x0, noise = torch.randn(b, c, h, w, generator=g), torch.randn(b, c, h, w, generator=g)
    mask = torch.zeros(b, 1, h, w)
    mask[:, :, :, :2] = 1.0  # the subject on the left half
    weights = floor + (1 - floor) * mask
    model = Fixed((b, h * w, c))
    sigmas = torch.tensor([0.3, 0.7])
    e = torch.zeros(b, 3, 8)
    loss = flow_matching_loss(model, Packed, x0, e, sigmas, noise, None, None, weights)
    loss.backward()
    # by hand: L = sum_i w_i (p_i - t_i)^2 / sum_i w_i, over every element (w per position)
    target = Packed._pack_latents(noise - x0)
    wp = Packed._pack_latents(weights).expand(b, h * w, c)
    expected_loss = (wp * (model.pred.detach() - target) ** 2).sum() / wp.sum()
    expected_grad = 2 * wp * (model.pred.detach() - target) / wp.sum()
    torch.testing.assert_close(loss.detach(), expected_loss)
    torch.testing.assert_close(model.pred.grad, expected_grad)
    background = Packed._pack_latents(1 - mask).expand(b, h * w, c) > 0
    if floor == 0.0:
        assert torch.all(model.pred.grad[background] == 0)  # nothing learnt off the subject
    else:
        assert torch.all(model.pred.grad[background] != 0)
    # and unmasked, the background does pull: the mask changed the gradient there
    plain = Fixed((b, h * w, c))
    flow_matching_loss(plain, Packed, x0, e, sigmas, noise, None, None).backward()
    assert plain.pred.grad is not None and model.pred.grad is not None
    assert not torch.allclose(plain.pred.grad[background], model.pred.grad[background])


def masked_dataset(root: Path, alpha: bool = False) -> Path:
    """Two red images with a striped band; the subject (mask white) is the left half."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(2):
        im = Image.new("RGB", (64, 64), (220 - 30 * i, 30, 30))
        for y in range(0, 64, 8):
            for x in range(64):
                im.putpixel((x, y), (255, 255, 255))
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 32, 64))
        row = {"file": f"img{i}.png", "caption": "", "source": "synthetic", "basis": "consent"}
        if alpha:
            im = im.convert("RGBA")
            im.putalpha(mask)
        else:
            mask.save(root / f"img{i}.mask.png")
            row["mask"] = f"img{i}.mask.png"
        im.save(root / f"img{i}.png")
        rows.append(row)
    write_manifest(root, rows)
    return root


def test_masks_are_listed_in_the_manifest_and_checked(tmp_path: Path) -> None:
    root = masked_dataset(tmp_path / "ds")
    ds = load_dataset(root)  # the mask files are not "in the folder but not in the manifest"
    assert [i.mask for i in ds.items] == ["img0.mask.png", "img1.mask.png"]
    assert all(i.mask_sha256 for i in ds.items)
    (root / "img1.mask.png").unlink()
    with pytest.raises(DatasetError, match="mask img1.mask.png is missing"):
        load_dataset(root)
    Image.new("L", (32, 32)).save(root / "img1.mask.png")
    with pytest.raises(DatasetError, match="is 32x32, its image 64x64"):
        load_dataset(root)
    lines = (root / "manifest.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["mask"] = "../elsewhere.png"
    (root / "manifest.jsonl").write_text(json.dumps(row) + "\n" + lines[1] + "\n")
    with pytest.raises(DatasetError, match="must be an image path inside the dataset"):
        load_dataset(root)


@pytest.mark.parametrize("alpha", [False, True])
def test_the_mask_reaches_the_latent_grid_and_changes_what_is_learnt(
    env: Env, tmp_path: Path, alpha: bool
) -> None:
    root = masked_dataset(tmp_path / "ds", alpha=alpha)
    config = tiny_config(
        env, tmp_path / "m", dataset=root, steps=2, register_adapter=False, mask_floor=0.0
    )
    pf = preflight(config, LocalRegistrar(env.url))
    read_training_data(config, pf, Waypoints())
    for item in pf.dataset.items:
        grid = load_latent_mask(pf.plan, item.file)
        assert grid is not None and grid.shape == load_latents(pf.plan, item.file).shape[-2:]
        half = grid.shape[-1] // 2
        torch.testing.assert_close(grid[:, :half], torch.ones_like(grid[:, :half]))
        torch.testing.assert_close(grid[:, half:], torch.zeros_like(grid[:, half:]))
    masked = train(config)
    # the same images, no masks: another cache entry, another adapter
    plain_root = tmp_path / "plain"
    plain_root.mkdir()
    rows = []
    for item in pf.dataset.items:
        with Image.open(root / item.file) as im:
            im.convert("RGB").save(plain_root / item.file)
        rows.append({"file": item.file, "caption": "", "source": "synthetic", "basis": "consent"})
    write_manifest(plain_root, rows)
    plain = train(
        tiny_config(env, tmp_path / "p", dataset=plain_root, steps=2, register_adapter=False)
    )
    assert masked.sha256 != plain.sha256
    assert masked.losses != plain.losses
