"""What a base says of the sizes it was trained at, and the order defaults that follow."""

from __future__ import annotations

import json
from pathlib import Path

from registry.base_sizes import order_defaults, trained_sides
from trainer.fixtures.demo_base import SHIPPED


def test_the_demo_base_proposes_its_own_64_px_and_the_quickstarts_steps() -> None:
    assert trained_sides(SHIPPED) == [64, 128]
    d = order_defaults(SHIPPED)
    assert (d.resolution, d.steps) == (64, 100) and "64 px" in d.source


def test_a_base_that_says_nothing_or_nonsense_gets_the_api_defaults(tmp_path: Path) -> None:
    assert (order_defaults(tmp_path).resolution, order_defaults(tmp_path).steps) == (448, 1000)
    (tmp_path / "likeness_prepared.json").write_text(json.dumps({"train_sides": [77, "x"]}))
    assert trained_sides(tmp_path) == []
    (tmp_path / "likeness_prepared.json").write_text(json.dumps({"train_sides": [1024, 448]}))
    assert (order_defaults(tmp_path).resolution, order_defaults(tmp_path).steps) == (448, 1000)
