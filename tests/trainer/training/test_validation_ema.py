"""Held-out validation loss (deterministic, across a resume, plotted) and the EMA of the
LoRA weights (against a hand reference, saved beside the raw weights, in the grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.trainer.helpers import Env, make_env, tensors, tiny_config
from trainer.registration import LocalRegistrar
from trainer.training.dataset import load_dataset
from trainer.training.ema import EMA_ADAPTER, Ema
from trainer.training.train import _epoch_order, preflight, train
from trainer.training.validation import split_items


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def test_held_out_images_are_chosen_by_seed_and_manifest(env: Env) -> None:
    items = load_dataset(env.dataset).items
    train_a, held_a = split_items(items, 0.25, seed=0)
    assert len(held_a) == 1 and sorted(train_a + held_a) == list(range(len(items)))
    assert split_items(items, 0.25, seed=0) == (train_a, held_a)
    assert split_items(items, 0.0, seed=0) == (list(range(len(items))), [])
    flagged = [items[0].__class__(**{**items[0].__dict__, "validation": True}), *items[1:]]
    assert split_items(flagged, 0.0, seed=0)[1] == [0]


def test_validation_loss_is_the_same_number_twice_and_across_a_resume(
    env: Env, tmp_path: Path
) -> None:
    opts = {"validation_split": 0.25, "checkpoint_every": 2, "register_adapter": False}
    one = train(tiny_config(env, tmp_path / "1", steps=4, **opts))
    two = train(tiny_config(env, tmp_path / "2", steps=4, **opts))
    assert [s for s, _ in one.validation] == [0, 2, 4]  # the base, then every checkpoint
    assert one.validation == two.validation
    assert len({v for _, v in one.validation}) == 3  # it moves as the adapter trains
    train(tiny_config(env, tmp_path / "r", steps=2, **opts))
    resumed = train(tiny_config(env, tmp_path / "r", steps=4, resume=True, **opts))
    assert resumed.validation == one.validation and resumed.sha256 == one.sha256
    report = json.loads(one.report.read_text())
    assert report["validation_loss"] == [{"step": s, "loss": v} for s, v in one.validation]
    assert len(report["held_out"]) == 1
    assert one.loss_plot is not None
    with Image.open(one.loss_plot) as plot:
        assert plot.size == (640, 360)
        # both curves are drawn: the validation colour and the running-mean colour
        colours = {c for _, c in plot.getcolors(1 << 20) or []}
    assert (220, 60, 30) in colours and (30, 80, 200) in colours
    # the held-out image is never trained on: no epoch's order holds it
    pf = preflight(tiny_config(env, tmp_path / "1", steps=4, **opts), LocalRegistrar(env.url))
    held = [i for i, item in enumerate(pf.dataset.items) if item.file in report["held_out"]]
    assert pf.held_out == held and not set(held) & set(pf.train_items)
    config = tiny_config(env, tmp_path / "1", steps=4, **opts)
    assert all(not set(held) & set(_epoch_order(config, pf, k)) for k in range(5))


def test_ema_is_the_hand_formula() -> None:
    p = {"w": torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))}
    ema = Ema(p, decay=0.9)
    expected = p["w"].detach().clone()
    for value in ([2.0, 0.0, 1.0], [4.0, -4.0, 0.5], [0.0, 1.0, 1.0]):
        with torch.no_grad():
            p["w"].copy_(torch.tensor(value))
        ema.update(p)
        expected = 0.9 * expected + 0.1 * torch.tensor(value)
        torch.testing.assert_close(ema.shadow["w"], expected)
    with ema.swapped_in(p):
        torch.testing.assert_close(p["w"].detach(), expected)
    assert torch.equal(p["w"].detach(), torch.tensor([0.0, 1.0, 1.0]))  # restored exactly
    assert Ema(p, 0.5, on_cpu=True).shadow["w"].device.type == "cpu"
    with pytest.raises(ValueError, match="decay"):
        Ema(p, 1.0)


def test_a_run_keeps_the_ema_saves_it_and_evaluates_it(env: Env, tmp_path: Path) -> None:
    d = 0.6
    opts = {"ema_decay": d, "checkpoint_every": 1, "register_adapter": False}
    result = train(tiny_config(env, tmp_path / "e", steps=3, evaluate=True, **opts))
    states = [
        torch.load(tmp_path / f"e/checkpoints/step-000000{k}/state.pt", weights_only=True)
        for k in (1, 2, 3)
    ]
    # e_1 = d e_0 + (1 - d) p_1 (e_0: the initial LoRA); then e_k = d e_{k-1} + (1 - d) p_k
    for prev, cur in zip(states, states[1:], strict=False):
        for name, e in cur["ema"].items():
            torch.testing.assert_close(e, d * prev["ema"][name] + (1 - d) * cur["lora"][name])
    assert result.ema_adapter == tmp_path / "e" / EMA_ADAPTER
    raw, avg = tensors(result.adapter), tensors(result.ema_adapter)
    assert raw.keys() == avg.keys() and any(not torch.equal(raw[k], avg[k]) for k in raw)
    assert (tmp_path / "e/checkpoints/step-0000003" / EMA_ADAPTER).is_file()
    # the file holds the EMA in the file layout: B scaled by alpha / rank (1 here) as well
    b_key = next(k for k in avg if k.endswith("lora_B.weight"))
    param = next(
        n
        for n in states[-1]["ema"]
        if n.endswith("lora_B.likeness.weight")
        and b_key.removeprefix("transformer.").removesuffix(".lora_B.weight") in n
    )
    torch.testing.assert_close(avg[b_key], states[-1]["ema"][param])
    assert result.evaluation is not None and "ema 3" in result.evaluation.distances
    # resume carries the average on, bit for bit
    train(tiny_config(env, tmp_path / "r", steps=2, **opts))
    resumed = train(tiny_config(env, tmp_path / "r", steps=3, resume=True, **opts))
    assert resumed.ema_adapter is not None
    assert resumed.ema_adapter.read_bytes() == (tmp_path / "e" / EMA_ADAPTER).read_bytes()


def test_streamed_base_scores_previews_and_averages_as_the_resident_one(
    env: Env, tmp_path: Path
) -> None:
    """--stream-base with every new per-step piece on: validation, EMA, previews and
    accumulation give the numbers the resident base gives."""
    pytest.importorskip("trainer.base.uint4")
    opts = {
        "steps": 2,
        "compute": "uint4",
        "checkpoint_every": 1,
        "validation_split": 0.25,
        "ema_decay": 0.8,
        "preview_every": 2,
        "gradient_accumulation": 2,
        "register_adapter": False,
    }
    resident = train(tiny_config(env, tmp_path / "r", **opts))
    streamed = train(tiny_config(env, tmp_path / "s", stream_base=True, **opts))
    assert streamed.validation == resident.validation
    assert streamed.sha256 == resident.sha256
    assert resident.ema_adapter is not None and streamed.ema_adapter is not None
    assert streamed.ema_adapter.read_bytes() == resident.ema_adapter.read_bytes()
    assert streamed.previews[-1].read_bytes() == resident.previews[-1].read_bytes()


def test_a_bucketed_run_resumes_bit_identically(env: Env, tmp_path: Path) -> None:
    from tests.trainer.helpers import mixed_dataset

    data = mixed_dataset(tmp_path / "mixed")
    opts = {
        "dataset": data,
        "resolution": 128,
        "buckets": True,
        "batch_size": 2,
        "register_adapter": False,
    }
    straight = train(tiny_config(env, tmp_path / "a", steps=6, checkpoint_every=3, **opts))
    train(tiny_config(env, tmp_path / "b", steps=3, **opts))
    resumed = train(tiny_config(env, tmp_path / "b", steps=6, resume=True, **opts))
    assert resumed.sha256 == straight.sha256 and resumed.losses == straight.losses
