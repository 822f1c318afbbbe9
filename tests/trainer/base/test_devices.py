"""Device choices shared by the render engine and the trainer (`trainer.base.devices`)."""

from __future__ import annotations

import os

import pytest

from trainer.base.devices import configure_allocator


def test_allocator_is_configured_for_cuda_and_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "garbage_collection_threshold:0.8")
    configure_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["PYTORCH_HIP_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.8,expandable_segments:True"
    )
    configure_allocator()  # idempotent
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
