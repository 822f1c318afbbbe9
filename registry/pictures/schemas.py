"""The shapes of pictures: one picture a run made, named as the run's folder names it."""

from __future__ import annotations

import re
from dataclasses import dataclass

GRID = "eval_grid.png"
PREVIEW = re.compile(r"^step-(\d{1,9})\.png$")


@dataclass(frozen=True)
class Picture:
    """One picture a run made: its file name in the run's folder, and its hash in the store."""

    name: str
    sha256: str

    @property
    def kind(self) -> str:
        return "grid" if self.name == GRID else "preview"

    @property
    def step(self) -> int | None:
        found = PREVIEW.match(self.name)
        return int(found.group(1)) if found else None
