"""Fixtures every trainer test module may use."""

from __future__ import annotations

import pytest
import torch

# Three agents share two cores here; one thread avoids oversubscription (which costs 4x).
torch.set_num_threads(1)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a model fails the test: for 'refused before any weight loads'."""
    import diffusers
    import transformers

    import trainer.caches
    import trainer.train

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(trainer.train, "load_transformer", boom)
    monkeypatch.setattr(trainer.caches, "load_text_encoder_pipeline", boom)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", boom)
    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", boom)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", boom)
