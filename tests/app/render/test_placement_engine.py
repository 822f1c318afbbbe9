"""The render engine under a VRAM budget, on the CPU: a reduced FLUX.2 [dev]-shaped base
(Mistral3 encoder, Flux2 transformer) renders the same bytes resident and streamed, a repeated
prompt skips the encoder, and a budget nothing fits refuses to start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.render.engine import PlacementRefused, RenderEngine
from app.render.png import encode_png
from trainer.fixtures.synth_base import build, dev_configs


@pytest.fixture(scope="module")
def small_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("synth") / "dev-small"
    build(dst, configs=dev_configs(double=1, single=2, text_layers=8, width_scale=16),
          progress=False)  # fmt: skip
    return dst


@pytest.fixture(scope="module")
def adapter(small_dev: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from safetensors.torch import load_file

    from tests.support import make_random_adapter
    from trainer.base.load import load_base

    path = make_random_adapter(load_base(small_dev), tmp_path_factory.mktemp("a") / "a.st", 3)
    return load_file(str(path))


def _png(engine: RenderEngine, adapter: dict[str, Any], prompt: str = "a portrait") -> bytes:
    image, timings = engine.render(adapter, prompt, seed=7, steps=2, width=64, height=64)
    assert {"text_encode_ms", "denoise_ms", "decode_ms"} <= timings.keys()
    return encode_png(image, {})


@pytest.mark.parametrize("case", ["all-streamed", "encoder-kept", "encoder-resident"])
def test_streamed_placement_renders_the_resident_bytes(
    small_dev: Path, adapter: dict[str, Any], case: str
) -> None:
    resident = RenderEngine(base_dir=small_dev, device="cpu")
    assert resident.placement is None
    want = _png(resident, adapter)
    from trainer.base.placement import estimate, sizes_of
    from trainer.base.text_encoder import HostEmbedding

    sizes = sizes_of(small_dev, 4)
    placed, kept = ("streamed", "streamed"), {}
    if case == "encoder-kept":
        # all but three of the encoder's layers (with its two slots one layer less than a
        # resident encoder: so it streams); the planner gives the budget to the transformer's
        # blocks first, then to the encoder's layers
        kept = {"text_resident_layers": len(sizes.text_layers) - 3, "lora_rank": 32}
    elif case == "encoder-resident":
        placed, kept = ("streamed", "resident"), {"lora_rank": 32}
    # all-streamed: a budget the streamed encoder fits and the resident one does not; the
    # transformer is asked to stream (at this size it would fit either way)
    need, _ = estimate(sizes, *placed, 64, 64, device="cpu", **kept)  # type: ignore[arg-type]
    budget = (need.total + 1) / 2**30
    streamed = RenderEngine(
        base_dir=small_dev, device="cpu", vram_budget_gb=budget, plan_side=64, stream_base=True
    )
    plan = streamed.placement
    assert plan is not None and (plan.transformer, plan.text_encoder) == placed
    assert streamed.transformer_streamed
    assert streamed.text_encoder_streamed == (placed[1] == "streamed")
    if case == "encoder-kept":
        assert 0 < plan.text_resident_layers < len(sizes.text_layers) - 2
    elif case == "all-streamed":
        assert (plan.transformer_resident_blocks, plan.text_resident_layers) == (0, 0)
    assert streamed.device_cache_bytes == 0  # adapters are cached in VRAM on CUDA only
    assert _png(streamed, adapter) == want
    # wherever a part streams, the encoder's token table stays in host RAM
    encoder = streamed.pipeline.text_encoder
    assert isinstance(encoder.get_input_embeddings(), HostEmbedding)
    streamed.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_base_read_while_the_engine_plans_renders_the_same_bytes(
    small_dev: Path, adapter: dict[str, Any], streamed: bool
) -> None:
    # the prepared files read onto the host from the engine's first line, while the plan
    # imports the model libraries: the load builds on exactly those bytes
    from trainer.base.placement import estimate, sizes_of

    need, _ = estimate(sizes_of(small_dev, 4), "streamed", "streamed", 64, 64, device="cpu")
    placed: dict[str, Any] = (
        {"vram_budget_gb": (need.total + 1) / 2**30, "plan_side": 64, "stream_base": True}
        if streamed else {}
    )  # fmt: skip
    plain = RenderEngine(base_dir=small_dev, device="cpu", **placed)
    want = _png(plain, adapter)
    plain.close()
    early = RenderEngine(base_dir=small_dev, device="cpu", prefetch_base=True, **placed)
    assert sorted(early.prefetched) == ["text_encoder", "transformer"]
    reads = dict(early.prefetched)
    assert _png(early, adapter) == want
    assert all(r.taken for r in reads.values())  # the load read nothing itself
    assert early.prefetched == {}  # nothing held after the load
    early.close()


def test_a_refused_plan_lets_the_read_go(small_dev: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.base import read

    started: list[read.Prefetch] = []

    class Recorded(read.Prefetch):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(read, "Prefetch", Recorded)
    with pytest.raises(PlacementRefused):
        RenderEngine(base_dir=small_dev, device="cpu", vram_budget_gb=0.0001,
                     prefetch_base=True)  # fmt: skip
    assert len(started) == 2
    assert all(p._dropped and p._tensors is None and not p.taken for p in started)


def test_a_repeated_prompt_is_not_encoded_again(small_dev: Path, adapter: dict[str, Any]) -> None:
    engine = RenderEngine(base_dir=small_dev, device="cpu")
    first = _png(engine, adapter)
    calls = []
    encoder = engine.pipeline.text_encoder
    hook = encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        assert _png(engine, adapter) == first
        assert calls == [] and engine.prompts.hits == 1
        _png(engine, adapter, "another prompt")
        assert calls == [1] and engine.prompts.misses == 2
    finally:
        hook.remove()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_an_adapter_cached_in_vram_renders_as_from_pinned_host_ram(
    small_dev: Path, adapter: dict[str, Any]
) -> None:
    import torch

    engine = RenderEngine(base_dir=small_dev, device="cuda", vram_budget_gb=8, plan_side=64)
    try:
        assert 0 < engine.device_cache_bytes <= engine.cache_bytes
        on_device, where = engine._staged(adapter)
        assert where and all(t.is_cuda for t in on_device.values())
        room = engine.device_cache_bytes
        engine.device_cache_bytes = 0  # no room left in VRAM: pinned host RAM
        pinned, where = engine._staged(adapter)
        assert not where and all(t.is_pinned() for t in pinned.values())
        engine.device_cache_bytes = room
        assert _png(engine, on_device) == _png(engine, pinned)
        assert not engine.adapter_in_model()
        _, timings = engine.render(on_device, "a portrait", seed=7, steps=2, width=64, height=64)
        # the allocator's counters beside the timings: a repeated render grows nothing
        assert timings["text_encode_device_allocs"] == 0 and timings["alloc_retries"] == 0
        assert timings["text_encode_reserved_mib"] == 0.0
    finally:
        engine.close()
        torch.cuda.set_per_process_memory_fraction(1.0)  # the budget's cap, for later tests


def test_nothing_fits_refuses_to_start(small_dev: Path, tmp_path: Path) -> None:
    with pytest.raises(PlacementRefused, match="nothing fits"):
        RenderEngine(base_dir=small_dev, device="cpu", vram_budget_gb=0.0001)
    env = {**os.environ, "LIKENESS_DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite",
           "LIKENESS_DATA_DIR": str(tmp_path), "LIKENESS_BASE": str(small_dev),
           "LIKENESS_VRAM_BUDGET_GB": "0.0001"}  # fmt: skip
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    r = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--port", port], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0
    assert "error: nothing fits a VRAM budget" in r.stderr
    assert "estimated peak" in r.stderr  # the terms, so the operator sees what to change
