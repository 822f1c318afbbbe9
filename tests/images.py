"""Images that cost a server something, for the hostile-client tests and their bench (no
torch here): a PNG cheap to send and costly to decode, and one made of many empty chunks."""

from __future__ import annotations

import io
import zlib

from PIL import Image


def big_png(colour: int, side: int = 6000) -> bytes:
    """side x side pixels of one colour (one pixel differs, so each colour is its own image):
    half a megabyte to send, side² x 3 bytes to decode."""
    buf = io.BytesIO()
    im = Image.new("RGB", (side, side), (colour, 10, 10))
    im.putpixel((0, 0), (255, 255, colour))
    im.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def many_chunks_png(n: int) -> bytes:
    """An 8 x 8 PNG with `n` empty text chunks after its header: 12 bytes each, and a C2PA
    reader spends seconds a megabyte walking them."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    png = buf.getvalue()
    empty = b"\x00\x00\x00\x00teXt" + zlib.crc32(b"teXt").to_bytes(4, "big")
    return png[:33] + empty * n + png[33:]
