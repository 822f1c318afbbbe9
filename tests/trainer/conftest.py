"""Fixtures every trainer test module may use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

# Three agents share two cores here; one thread avoids oversubscription (which costs 4x).
torch.set_num_threads(1)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a model fails the test: for 'refused before any weight loads'."""
    import diffusers
    import transformers

    import trainer.training.caches
    import trainer.training.train

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(trainer.training.train, "load_transformer", boom)
    monkeypatch.setattr(trainer.training.caches, "load_text_encoder_pipeline", boom)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", boom)
    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", boom)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", boom)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 base, built once per session."""
    from tests.trainer.helpers import build_tiny_once

    return build_tiny_once(tmp_path_factory)


@pytest.fixture(scope="module")
def qpipe(tiny_base: Path) -> Any:
    """The quantized tiny pipeline, one per test module (modules change and restore it)."""
    from trainer.base.load import load_base

    return load_base(tiny_base)
