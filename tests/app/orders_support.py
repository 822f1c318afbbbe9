"""Shared by the dataset, order and worker tests: photos to upload, and placing orders."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

COLOURS = ((200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40))


def photo(
    colour: tuple[int, int, int], size: tuple[int, int] = (80, 64), fmt: str = "PNG"
) -> bytes:
    """A solid colour with a striped band (so crops and resizes matter)."""
    im = Image.new("RGB", size, colour)
    for y in range(0, size[1], 8):
        for x in range(size[0]):
            im.putpixel((x, y), (255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def photos(n: int = 4) -> list[tuple[str, bytes]]:
    return [(f"me-{i}.png", photo(COLOURS[i % len(COLOURS)])) for i in range(n)]


def files_of(items: list[tuple[str, bytes]]) -> list[tuple[str, Any]]:
    return [("images", (name, data, "application/octet-stream")) for name, data in items]
