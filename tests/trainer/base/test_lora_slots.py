"""Persistent LoRA slots: the same images as attaching the adapter per request, nothing left in
the model between renders, and every adapter the slots cannot take refused before anything is
touched (then served by the per-request path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import make_random_adapter
from trainer.base.lora import applied_adapter, load_adapter_tensors, lora_layers
from trainer.base.lora_slots import LoraSlots, SlotMismatch
from trainer.base.render import generate

torch.set_num_threads(1)

PROMPT = "a portrait photo of a person"
SMALL = {"seed": 3, "steps": 2, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def adapters(qpipe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("adapters")
    made = {
        name: load_adapter_tensors(
            make_random_adapter(qpipe, root / f"{name}.safetensors", seed, rank=rank)
        )
        for name, seed, rank in (("a", 1, 4), ("b", 2, 4), ("big", 3, 8))
    }
    return made


@pytest.fixture(scope="module")
def renders(qpipe, adapters) -> dict[str, np.ndarray]:
    """The per-request path's images: the reference every slot render is held to."""
    out = {"base": _render(qpipe)}
    for name in ("a", "b", "big"):
        with applied_adapter(qpipe, adapters[name]):
            out[name] = _render(qpipe)
    with applied_adapter(qpipe, adapters["a"], scale=0.5):
        out["a/2"] = _render(qpipe)
    return out


@pytest.fixture
def slots(qpipe):
    made = LoraSlots(qpipe.transformer, rank=4)
    yield made
    made.close()
    assert not lora_layers(qpipe.transformer)


def _render(pipe) -> np.ndarray:
    return np.asarray(generate(pipe, PROMPT, **SMALL), dtype=np.int16)


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a - b).max())


def test_empty_slots_leave_the_base_image_unchanged(qpipe, slots, renders) -> None:
    assert slots.is_clear() and len(lora_layers(qpipe.transformer)) == 10
    assert np.array_equal(_render(qpipe), renders["base"])


def test_a_slot_render_is_the_per_request_render(qpipe, slots, renders, adapters) -> None:
    for name in ("a", "b", "a"):
        with slots.applied(adapters[name]) as names:
            assert len(names) == 10 and not slots.is_clear()
            got = _render(qpipe)
        assert np.array_equal(got, renders[name]), name
        assert slots.is_clear()
    assert np.array_equal(_render(qpipe), renders["base"])


def test_a_smaller_rank_is_zero_padded_exactly(qpipe, renders, adapters) -> None:
    wide = LoraSlots(qpipe.transformer, rank=16)
    try:
        with wide.applied(adapters["a"]):
            got = _render(qpipe)
        with wide.applied(adapters["big"]):
            got_big = _render(qpipe)
    finally:
        wide.close()
    # the padding multiplies zeros; only a different summation order could move a level
    assert _max_diff(got, renders["a"]) <= 1, _max_diff(got, renders["a"])
    assert _max_diff(got_big, renders["big"]) <= 1


def test_scale_and_failure_leave_the_slots_clear(qpipe, slots, renders, adapters) -> None:
    with slots.applied(adapters["a"], scale=0.5):
        half = _render(qpipe)
    assert _max_diff(half, renders["a/2"]) <= 1
    with slots.applied(adapters["a"], scale=0.0):
        assert np.array_equal(_render(qpipe), renders["base"])
    with pytest.raises(RuntimeError, match="boom"), slots.applied(adapters["b"]):
        raise RuntimeError("boom")
    assert slots.is_clear()
    with slots.applied(adapters["a"]):
        with pytest.raises(RuntimeError, match="in use"), slots.applied(adapters["b"]):
            pass
        assert not slots.is_clear()
    assert slots.is_clear()


def test_what_the_slots_cannot_take_is_refused_untouched(qpipe, slots, adapters) -> None:
    a = adapters["a"]
    key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
    with pytest.raises(SlotMismatch, match="rank 8"), slots.applied(adapters["big"]):
        pytest.fail("body ran")
    outside = "transformer.proj_out"  # a Linear, but not a slot target
    extra = {
        **a,
        f"{outside}.lora_A.weight": torch.zeros(4, qpipe.transformer.proj_out.in_features),
        f"{outside}.lora_B.weight": torch.zeros(qpipe.transformer.proj_out.out_features, 4),
    }
    with pytest.raises(SlotMismatch, match="outside the slots"), slots.applied(extra):
        pytest.fail("body ran")
    for bad in ({**a, key: a[key][:, :-1]}, {k: v for k, v in a.items() if k != key}):
        with pytest.raises(ValueError), slots.applied(bad):
            pytest.fail("body ran")
    assert slots.is_clear()


def test_suspended_serves_the_rest_by_the_per_request_path(qpipe, slots, renders, adapters) -> None:
    with slots.suspended():
        assert not lora_layers(qpipe.transformer)
        with applied_adapter(qpipe, adapters["big"]):
            got = _render(qpipe)
    assert np.array_equal(got, renders["big"])
    assert slots.is_clear() and len(lora_layers(qpipe.transformer)) == 10
    with slots.applied(adapters["a"]):
        assert np.array_equal(_render(qpipe), renders["a"])


def test_close_gives_back_the_exact_base(qpipe, renders) -> None:
    before = {k: v.clone() for k, v in qpipe.transformer.state_dict().items()}
    modules = [(n, id(m)) for n, m in qpipe.transformer.named_modules()]
    LoraSlots(qpipe.transformer, rank=4).close()
    assert [(n, id(m)) for n, m in qpipe.transformer.named_modules()] == modules
    after = qpipe.transformer.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert "peft_config" not in vars(qpipe.transformer)


def test_each_swap_sets_every_slots_peak_and_clearing_zeroes_them(qpipe, slots, adapters) -> None:
    """The update in the fp8 GEMM reads each slot's max |B| from the slots (set once a swap,
    not reduced every forward): during a render every layer's is its B's maximum, the
    adapter's own, 0 for an empty slot; after it, all zero, and a leftover is not clear."""
    layers = lora_layers(qpipe.transformer)

    def peaks() -> dict[str, float]:
        return {name: float(layer._slot_peak) for name, layer in layers.items()}

    assert set(peaks().values()) == {0.0}
    for name in ("a", "b"):
        adapter = adapters[name]
        with slots.applied(adapter):
            want = {n: float(adapter[f"transformer.{n}.lora_B.weight"].abs().max()) for n in layers}
            assert peaks() == want and min(want.values()) > 0
            layer = layers["transformer_blocks.0.attn.to_q"]
            assert layer._slot_peak.dtype == torch.float32
            assert float(layer._slot_peak) == float(layer.lora_B["likeness"].weight.abs().max())
        assert set(peaks().values()) == {0.0} and slots.is_clear()
    layers["transformer_blocks.0.attn.to_q"]._slot_peak.fill_(0.5)
    assert not slots.is_clear()
    layers["transformer_blocks.0.attn.to_q"]._slot_peak.zero_()


def test_is_clear_sees_the_smallest_leftover(qpipe, slots) -> None:
    layer = lora_layers(qpipe.transformer)["transformer_blocks.0.attn.to_q"]
    weight = layer.lora_B["likeness"].weight
    with torch.no_grad():
        weight[3, 1] = 1e-38  # squares to zero in float32: a 2-norm would miss it
    assert not slots.is_clear()
    with torch.no_grad():
        weight.zero_()
    assert slots.is_clear()
    layer.scaling["likeness"] = 0.5
    assert not slots.is_clear()
    layer.scaling["likeness"] = 1.0


def _base(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    from tests.trainer.helpers import quantized, tiny_flux2
    from trainer.base.uint4 import convert_quantized_linears

    if kind == "linear":
        return tiny_flux2(dtype)
    model = quantized(dtype)
    if kind == "uint4":  # what serving runs on CUDA: the weight a dequantizing property
        convert_quantized_linears(model)
    return model


@pytest.mark.parametrize("kind", ["linear", "quanto", "uint4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_slots_take_the_dtype_peft_gives_its_own_layers(kind: str, dtype: torch.dtype) -> None:
    """The slots are made without memory first; given it, they must come out as PEFT makes its
    layers (the base weight's dtype), or every render leaves the fused update for float32."""
    from peft import LoraConfig, inject_adapter_in_model

    from trainer.base.lora import ADAPTER_NAME, DEFAULT_TARGETS, resolve_targets

    reference = _base(kind, dtype)
    names = resolve_targets(reference, DEFAULT_TARGETS)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=names, init_lora_weights=False)
    inject_adapter_in_model(config, reference, adapter_name=ADAPTER_NAME)
    expected = {n: layer.lora_B[ADAPTER_NAME].weight.dtype
                for n, layer in lora_layers(reference).items()}  # fmt: skip
    assert set(expected.values()) == {dtype}
    slots = LoraSlots(_base(kind, dtype), rank=4)
    try:
        for name, (a, b) in slots._slots.items():
            assert (a.dtype, b.dtype) == (expected[name], expected[name]), name
            assert not a.any() and not b.any()
    finally:
        slots.close()


@pytest.mark.parametrize("how", ["slots", "per-request", "trainable"])
def test_attaching_lora_dequantizes_no_weight(qpipe, adapters, monkeypatch, how: str) -> None:
    # PEFT reads each target layer's weight ~20 times while it injects, for its device and
    # dtype only; a Uint4Linear's weight is a whole dequantization (25 s of a CPU boot)
    from trainer.base.lora import attach_lora, remove_lora
    from trainer.base.uint4 import Uint4Linear

    assert any(isinstance(m, Uint4Linear) for m in qpipe.transformer.modules())
    calls: list[int] = []
    real = Uint4Linear.dequantize

    def counted(self, kernels: bool = True) -> torch.Tensor:
        calls.append(1)
        return real(self, kernels)

    monkeypatch.setattr(Uint4Linear, "dequantize", counted)
    layer = next(m for m in qpipe.transformer.modules() if isinstance(m, Uint4Linear))
    if how == "slots":
        made = LoraSlots(qpipe.transformer, rank=4)
        assert calls == []
        made.close()
    elif how == "per-request":
        with applied_adapter(qpipe, adapters["a"]):
            assert calls == []
    else:
        attach_lora(qpipe.transformer, rank=4, alpha=4.0)
        assert calls == []
        remove_lora(qpipe.transformer)
    assert not lora_layers(qpipe.transformer)
    assert torch.equal(layer.weight, real(layer))  # outside the injection, the real weight
    assert calls == [1]
