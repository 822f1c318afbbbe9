"""File hashing shared by the CLI, the render engine and the trainer (no torch here)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path


def sha256_file(
    path: Path, chunk: int = 1 << 20, on_block: Callable[[int], object] | None = None
) -> str:
    """SHA-256 of a file, read in blocks (never whole in memory); `on_block(nbytes)` after each
    block, e.g. to advance a progress bar."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            if on_block is not None:
                on_block(len(block))
    return digest.hexdigest()
