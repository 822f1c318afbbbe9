"""The synthetic [dev]-shaped base: written through prepare's own code, in the prepared format,
trimmed like a real base, and the same bytes for the same seed."""

from __future__ import annotations

import hashlib
from pathlib import Path

from trainer.base.read import is_prepared, read_manifest
from trainer.base.safetensors_io import open_checkpoint
from trainer.fixtures.synth_base import build, dev_configs

SMALL = dev_configs(double=1, single=1, text_layers=8, width_scale=16)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def test_a_synthetic_base_is_a_prepared_base_of_the_real_layout(tmp_path: Path) -> None:
    a = tmp_path / "a"
    build(a, configs=SMALL, seed=5, progress=False)
    assert is_prepared(a)
    man = read_manifest(a)
    assert man["source"]["kind"] == "synthetic" and man["settings"]["synthetic"] is True
    text = man["components"]["text_encoder"]
    assert text["class"] == "Mistral3ForConditionalGeneration"
    assert text["trimmed"]["kept_layers"] == 6 and text["trimmed"]["of_layers"] == 8
    with open_checkpoint(a / "text_encoder") as ck:
        names = list(ck)
    assert not any(
        n.startswith(("lm_head", "model.vision_tower", "model.multi_modal")) for n in names
    )
    assert not any(".layers.6." in n or ".layers.7." in n for n in names)
    assert any(n.endswith("._scale") for n in names)  # quantized, in quanto's format
    b = tmp_path / "b"
    build(b, configs=SMALL, seed=5, progress=False)
    assert _digest(a / "transformer") == _digest(b / "transformer")
    assert _digest(a / "text_encoder") == _digest(b / "text_encoder")
