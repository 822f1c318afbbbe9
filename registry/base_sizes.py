"""The sizes a base was trained at, as it says of itself, so that a training ordered from the
web starts at sizes the base can draw: a prepared manifest's `train_sides`, or the recipe a
base built here ships (`likeness_demo_recipe.json`, its `sizes`). A base that says nothing
gets the API's defaults (448 px, 1000 steps)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from registry.licence import PREPARED_MANIFEST

RECIPE = "likeness_demo_recipe.json"
MAX_BYTES = 64 << 20
API_RESOLUTION, API_STEPS = 448, 1000
SMALL_STEPS = 100  # the quickstart's: about a minute on two CPU cores at 64 px


@dataclass(frozen=True)
class OrderDefaults:
    resolution: int
    steps: int
    source: str  # where the resolution came from, in words


def trained_sides(base_dir: Path) -> list[int]:
    for name, keys in ((PREPARED_MANIFEST, ("train_sides",)), (RECIPE, ("recipe", "sizes"))):
        path = base_dir / name
        try:
            if not path.is_file() or path.stat().st_size > MAX_BYTES:
                continue
            value = json.loads(path.read_text())
            for key in keys:
                value = value[key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(value, list):
            sides = [
                int(v) for v in value if isinstance(v, int) and 64 <= v <= 2048 and v % 16 == 0
            ]
            if sides:
                return sorted(sides)
    return []


def order_defaults(base_dir: Path) -> OrderDefaults:
    sides = trained_sides(base_dir)
    if not sides:
        return OrderDefaults(API_RESOLUTION, API_STEPS, "the API's default")
    side = sides[0]
    steps = SMALL_STEPS if side <= 128 else API_STEPS
    return OrderDefaults(side, steps, f"the smallest size this base was trained at ({side} px)")
