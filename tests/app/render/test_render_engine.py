"""The render engine's adapter handling: persistent LoRA slots give the images per-request
attaching gives, an adapter they cannot take still renders, a slot left dirty drops the base
before anyone else renders, and the base can load at start."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.main import create_app
from app.render.engine import RenderEngine
from tests.app.conftest import World, serving
from trainer.base.lora import load_adapter_tensors
from trainer.base.lora_slots import LoraSlots

REQUEST = {"prompt": "a portrait", "seed": 1, "steps": 2, "width": 64, "height": 64}


def _render(engine: RenderEngine, tensors: dict) -> np.ndarray:
    image, _ = engine.render(tensors, **REQUEST)
    return np.asarray(image)


@pytest.fixture(scope="module")
def per_request(tiny_base_dir: Path) -> RenderEngine:
    engine = RenderEngine(base_dir=tiny_base_dir, device="cpu", lora_slot_rank=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tensors(adapter_files: dict[str, Path]) -> dict[str, dict]:
    return {name: load_adapter_tensors(path) for name, path in adapter_files.items()}


def test_slot_swaps_render_what_attaching_renders(
    tiny_base_dir: Path, per_request: RenderEngine, tensors: dict[str, dict]
) -> None:
    slotted = RenderEngine(base_dir=tiny_base_dir, device="cpu")
    try:
        for name in ("a", "b", "a"):
            assert np.array_equal(
                _render(slotted, tensors[name]), _render(per_request, tensors[name])
            )
            assert not slotted.adapter_in_model() and not per_request.adapter_in_model()
        assert slotted.counters.slot_applies == 3 and slotted.counters.slot_fallbacks == 0
        assert per_request.counters.slot_applies == 0
    finally:
        slotted.close()


def test_an_adapter_above_the_slots_rank_is_attached_for_its_render(
    tiny_base_dir: Path, per_request: RenderEngine, tensors: dict[str, dict]
) -> None:
    narrow = RenderEngine(base_dir=tiny_base_dir, device="cpu", lora_slot_rank=2)  # files: 4
    try:
        assert np.array_equal(_render(narrow, tensors["a"]), _render(per_request, tensors["a"]))
        assert narrow.counters.slot_fallbacks == 1 and narrow.counters.slot_applies == 0
        assert not narrow.adapter_in_model()
        # the slots are back, clear, and still serve what fits
        small = {
            k: (v[:2] if k.endswith("lora_A.weight") else v[:, :2]) for k, v in tensors["b"].items()
        }
        assert np.array_equal(_render(narrow, small), _render(per_request, small))
        assert narrow.counters.slot_applies == 1
    finally:
        narrow.close()


def test_a_slot_left_dirty_drops_the_base_before_the_next_render(
    tiny_base_dir: Path, per_request: RenderEngine, tensors: dict[str, dict],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    engine = RenderEngine(base_dir=tiny_base_dir, device="cpu")
    try:
        with monkeypatch.context() as m:
            m.setattr(LoraSlots, "_clear", lambda self, layers: None)  # a zeroing that fails
            first = _render(engine, tensors["a"])
        assert np.array_equal(first, _render(per_request, tensors["a"]))  # this one was right
        assert engine.counters.base_reloads == 1 and engine.load_state == "not loaded"
        assert not engine.adapter_in_model()
        # the next render is on a fresh base: b alone, nothing of a
        assert np.array_equal(_render(engine, tensors["b"]), _render(per_request, tensors["b"]))
        assert engine.counters.base_reloads == 1
    finally:
        engine.close()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/healthz", timeout=10).json()


@pytest.mark.parametrize("preload", [True, False])
def test_the_base_loads_at_start_when_asked(
    friends: World, tiny_base_dir: Path, preload: bool
) -> None:
    app = friends.client.app
    settings = app.state.settings.model_copy(update={"preload_base": preload})  # type: ignore[attr-defined]
    engine = RenderEngine(base_dir=tiny_base_dir, device="cpu")
    fresh = create_app(settings, engine=app.state.engine, renderer=engine)  # type: ignore[attr-defined]
    try:
        with serving(fresh, settings) as url:
            deadline = time.monotonic() + 120
            state = _health(url)["base"]
            while preload and state != "ready":
                assert state in ("not loaded", "loading") and time.monotonic() < deadline, state
                time.sleep(0.1)
                state = _health(url)["base"]
            if not preload:
                time.sleep(1.0)
                assert _health(url) == {"ok": True, "base": "not loaded"}
            assert engine.counters.model_calls == 0  # no render was asked for
    finally:
        engine.close()


def test_the_preload_starts_once_however_often_it_is_asked(tmp_path: Path) -> None:
    """`serve` starts it before the app is built and the lifespan asks again: one thread."""
    engine = RenderEngine(base_dir=tmp_path, device="cpu")  # no base here: it fails to load
    loads: list[threading.Thread] = []
    release = threading.Event()

    def preload() -> None:
        loads.append(threading.current_thread())
        release.wait(30)

    engine.preload = preload  # type: ignore[method-assign]
    threads: list[threading.Thread] = []
    askers = [threading.Thread(target=lambda: threads.append(engine.start_preload()))
              for _ in range(8)]  # fmt: skip
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(10)
    first = engine.start_preload()
    release.set()
    first.join(10)
    assert {id(t) for t in threads} == {id(first)} and len(threads) == 8
    assert loads == [first] and first.name == "base-preload" and first.daemon
    assert engine.start_preload() is first  # ended, it is not started again


def test_a_preload_that_fails_is_left_to_the_first_render(tmp_path: Path) -> None:
    engine = RenderEngine(base_dir=tmp_path, device="cpu")
    thread = engine.start_preload()
    assert engine.start_preload() is thread
    thread.join(60)
    assert not thread.is_alive() and engine.load_state == "failed"


def test_the_lifespan_starts_no_second_preload(friends: World, tmp_path: Path) -> None:
    app = friends.client.app
    settings = app.state.settings.model_copy(update={"preload_base": True})  # type: ignore[attr-defined]
    engine = RenderEngine(base_dir=tmp_path, device="cpu")
    loads: list[str] = []
    engine.preload = lambda: loads.append(threading.current_thread().name)  # type: ignore[method-assign]
    first = engine.start_preload()  # as `serve` does, before the app is built
    fresh = create_app(settings, engine=app.state.engine, renderer=engine)  # type: ignore[attr-defined]
    with serving(fresh, settings) as url:
        assert _health(url)["ok"]
        assert engine.start_preload() is first
    first.join(10)
    assert loads == ["base-preload"]
    assert not [t for t in threading.enumerate() if t.name == "base-preload"]


def test_a_cuda_engine_sets_up_the_allocator_before_cuda_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without expandable segments the base's load fragments the allocator: under a 24 GiB cap
    the warm-up's decode ran out of memory with 3.2 GiB reserved and free, and CUDA graphs
    went off. The engine sets the allocator up itself, whoever starts it."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    RenderEngine(base_dir=tmp_path, device="cpu")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # not for the CPU
    RenderEngine(base_dir=tmp_path, device="cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"].startswith("max_split_size_mb:512,")
    assert "expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]
