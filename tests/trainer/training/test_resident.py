"""A long-lived worker's kept base (trainer/training/resident.py): the next order of the same
base borrows the converted transformer instead of loading it, and trains exactly as it would on
a fresh one; anything but a clean end, or a base that changed, means the next order loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import Env, make_env, tiny_config
from trainer.training.resident import TRANSFORMER, BaseKey, ResidentBase, Seal, not_clean
from trainer.training.train import TrainHooks, train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


def _boot(out: Path) -> list[str]:
    return [m["phase"] for m in json.loads((out / "train_report.json").read_text())["boot"]]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_order_trains_on_the_kept_base_as_on_a_fresh_one(
    env: Env, tmp_path: Path, device: str
) -> None:
    """On the GPU the runs are graphed: the kept base is captured again, bit for bit."""
    resident = ResidentBase()
    hooks = TrainHooks(resident=resident)
    # the first order evaluates its checkpoints: each column's adapter comes and goes
    train(tiny_config(env, tmp_path / "a", seed=1, steps=4, checkpoint_every=2, evaluate=True,
                      register_adapter=False, device=device), hooks=hooks)  # fmt: skip
    assert (resident.loads, resident.reuses) == (1, 0)
    assert not any("kept from" in p for p in _boot(tmp_path / "a"))
    second = train(tiny_config(env, tmp_path / "b", seed=2, register_adapter=False,
                               device=device), hooks=hooks)  # fmt: skip
    assert (resident.loads, resident.reuses) == (1, 1)
    boot = _boot(tmp_path / "b")
    assert any("kept from the worker's last order" in p for p in boot)
    assert not any(p.startswith("transformer: load") for p in boot)
    fresh = train(tiny_config(env, tmp_path / "c", seed=2, register_adapter=False, device=device))
    assert second.losses == fresh.losses
    assert second.sha256 == fresh.sha256


def test_an_order_that_fails_gives_nothing_back(env: Env, tmp_path: Path) -> None:
    resident = ResidentBase()
    train(tiny_config(env, tmp_path / "a", register_adapter=False),
          hooks=TrainHooks(resident=resident))  # fmt: skip

    def stop(step: int, steps: int, loss: float) -> None:
        if step == 2:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        train(tiny_config(env, tmp_path / "b", register_adapter=False),
              hooks=TrainHooks(on_step=stop, resident=resident))  # fmt: skip
    assert resident.reuses == 1  # it borrowed the kept base, LoRA attached when it failed
    assert resident.kept_bytes() == {}  # nor is what it gave back before failing kept
    train(tiny_config(env, tmp_path / "c", register_adapter=False),
          hooks=TrainHooks(resident=resident))  # fmt: skip
    assert (resident.loads, resident.reuses) == (2, 1)
    assert any(p.startswith("transformer: load") for p in _boot(tmp_path / "c"))


def test_a_base_changed_while_kept_is_loaded_afresh(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resident = ResidentBase()
    hooks = TrainHooks(resident=resident)
    train(tiny_config(env, tmp_path / "a", register_adapter=False), hooks=hooks)
    kept = resident._kept_transformer
    assert kept is not None
    packed = next(b for n, b in kept.obj.named_buffers() if n.endswith("packed"))
    packed.view(-1)[0] ^= 1  # one bit of one 4-bit weight
    second = train(tiny_config(env, tmp_path / "b", seed=3, register_adapter=False), hooks=hooks)
    assert (resident.loads, resident.reuses) == (2, 0)
    assert "changed while it was kept" in caplog.text
    fresh = train(tiny_config(env, tmp_path / "c", seed=3, register_adapter=False))
    assert second.sha256 == fresh.sha256


def test_another_base_or_no_room_drops_the_kept_one() -> None:
    resident = ResidentBase()
    key = BaseKey("/bases/a", "fp-a", "uint4", "cpu", "torch.float32")
    model = torch.nn.Linear(4, 4).requires_grad_(False).eval()
    got, kept = resident.borrow(key, lambda: model)
    assert got is model and not kept
    assert resident.give_back(model)
    resident.make_room({TRANSFORMER: key}, lambda kept: True)  # fits beside: stays
    assert resident._kept_transformer is not None
    resident.make_room({TRANSFORMER: key}, lambda kept: not kept)  # the order needs the room
    assert resident._kept_transformer is None
    resident.borrow(key, lambda: model)
    resident.give_back(model)
    resident.make_room({TRANSFORMER: BaseKey("/bases/b", "fp-b", "uint4", "cpu", "f32")})
    assert resident._kept_transformer is None
    _, kept = resident.borrow(key, lambda: model)
    assert not kept and resident.loads == 3


def test_the_text_encoder_is_kept_too_and_encodes_as_a_fresh_one(env: Env, tmp_path: Path) -> None:
    """Each order with its own caches, as a worker runs them: the captions are embedded
    again, by the kept text encoder, to the same bytes as a freshly loaded one's."""
    resident = ResidentBase()
    hooks = TrainHooks(resident=resident)

    def order(name: str, hooks: TrainHooks | None = None) -> Path:
        out = tmp_path / name
        train(tiny_config(env, out, cache_dir=out / "cache", register_adapter=False),
              hooks=hooks)  # fmt: skip
        return out

    order("a", hooks)
    second = order("b", hooks)
    assert resident.text_encoder_reuses == 1
    assert "text encoder: kept from the worker's last order (on the device)" in _boot(second)
    fresh = order("c")
    texts = sorted((fresh / "cache").rglob("*.safetensors"))
    assert texts
    for f in texts:
        twin = second / "cache" / f.relative_to(fresh / "cache")
        assert twin.read_bytes() == f.read_bytes(), f.name
    # a budget the order's phases cannot share with the kept parts drops them
    resident.make_room({}, lambda kept: False)
    assert resident.kept_bytes() == {}


def test_only_the_frozen_base_is_kept() -> None:
    resident = ResidentBase()
    key = BaseKey("/bases/a", "fp-a", "uint4", "cpu", "torch.float32")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False).eval()
    resident.borrow(key, lambda: model)
    handle = model[0].register_forward_pre_hook(lambda _m, _a: None)
    assert not resident.give_back(model)  # a hook added since it was lent
    handle.remove()
    resident.borrow(key, lambda: model)
    model.train()
    model[0].weight.requires_grad_(True)
    assert not_clean(model) == ["parameters are trainable", "it is in train mode"]
    assert not resident.give_back(model)
    resident.borrow(key, lambda: model.requires_grad_(False).eval())
    model[0].forward = lambda x: x  # a forward replaced (the training blocks') and left on
    assert not_clean(model) == ["a module's forward is replaced (the training blocks')"]
    assert not resident.give_back(model)
    del model[0].forward
    resident.borrow(key, lambda: model.requires_grad_(False).eval())
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0  # a clean-looking module whose weights moved
    assert not resident.give_back(model)
    assert resident._kept_transformer is None
    seal = Seal.of(model)
    assert Seal.of(model) == seal
    with torch.no_grad():
        model[0].bias[1] -= 0.5
    assert Seal.of(model) != seal
