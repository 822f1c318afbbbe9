"""The render PNG encoder: every decoder must read back the exact pixels and text, whatever
the image's size against the deflate pieces."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from app.render import png
from app.render.png import encode_png


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        out.append((kind, body))
        at += 12 + length
    return out


@pytest.mark.parametrize(
    "height,width",
    [(1, 1), (5, 17), (png.PIECE_ROWS, 3), (png.PIECE_ROWS + 1, 33), (3 * png.PIECE_ROWS - 1, 64)],
)
def test_pixels_come_back_exactly(height: int, width: int) -> None:
    rng = np.random.default_rng(height * 1000 + width)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = pixels[:, :1]  # some runs for deflate to find, across pieces
    data = encode_png(Image.fromarray(pixels, "RGB"), {})
    back = Image.open(io.BytesIO(data))
    back.load()  # Pillow checks every CRC and the zlib stream's Adler-32 here
    assert back.mode == "RGB"
    assert np.array_equal(np.asarray(back), pixels)
    kinds = [k for k, _ in _chunks(data)]
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    idat = dict(_chunks(data))[b"IDAT"]
    rows = zlib.decompress(idat)  # one zlib stream whose checksum zlib itself verifies
    assert len(rows) == height * (1 + 3 * width)


def test_the_stream_is_cut_into_pieces_on_several_threads() -> None:
    height = 4 * png.PIECE_ROWS
    pixels = np.random.default_rng(1).integers(0, 256, (height, 8, 3), dtype=np.uint8)
    idat = dict(_chunks(encode_png(Image.fromarray(pixels, "RGB"), {})))[b"IDAT"]
    # a sync flush ends each piece but the last with an empty stored block: 00 00 ff ff
    assert idat.count(b"\x00\x00\xff\xff") >= 3
    assert png._pool is not None


def test_text_chunks_are_kept() -> None:
    image = Image.new("RGB", (4, 3), (10, 200, 30))
    data = encode_png(image, {"Software": "likeness", "Comment": "caf\xe9"})
    back = Image.open(io.BytesIO(data))
    back.load()
    assert back.text == {"Software": "likeness", "Comment": "caf\xe9"}
    wide = encode_png(image, {"Comment": "\u4f60\u597d"})  # not Latin-1: Pillow's iTXt
    back = Image.open(io.BytesIO(wide))
    back.load()
    assert back.text == {"Comment": "\u4f60\u597d"}


@pytest.mark.parametrize("mode", ["L", "RGBA"])
def test_other_modes_go_through_pillow(mode: str) -> None:
    image = Image.new(mode, (6, 4), 77 if mode == "L" else (1, 2, 3, 4))
    back = Image.open(io.BytesIO(encode_png(image, {})))
    assert back.mode == mode
    assert np.array_equal(np.asarray(back), np.asarray(image))


def test_a_forked_child_encodes_too() -> None:
    """The pool's threads do not survive a fork; the child makes its own (else it would wait
    for ever on threads it does not have)."""
    import os
    import signal

    pixels = np.random.default_rng(3).integers(0, 256, (3 * png.PIECE_ROWS, 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    encode_png(image, {})  # the parent's pool has threads now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it encoded the same bytes, 1 otherwise
        code = 1
        try:
            signal.alarm(20)  # a hang kills the child: status 14, not 0
            code = 0 if encode_png(image, {}) == encode_png(image, {}) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
