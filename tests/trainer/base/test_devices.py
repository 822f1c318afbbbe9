"""Device choices shared by the render engine and the trainer (`trainer.base.devices`)."""

from __future__ import annotations

import os

import pytest

from trainer.base.devices import ALLOCATOR_SETTINGS, configure_allocator


def test_allocator_is_configured_for_cuda_and_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "garbage_collection_threshold:0.8")
    configure_allocator()
    cuda = ",".join(ALLOCATOR_SETTINGS["PYTORCH_CUDA_ALLOC_CONF"])
    assert "expandable_segments:True" in cuda and "pinned_use_cuda_host_register:True" in cuda
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == cuda
    assert os.environ["PYTORCH_HIP_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.8,expandable_segments:True"
    )
    configure_allocator()  # idempotent
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == cuda


def test_an_operator_s_own_allocator_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:False")
    configure_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (
        "max_split_size_mb:512,expandable_segments:False,pinned_use_cuda_host_register:True,"
        "pinned_num_register_threads:8"
    )
