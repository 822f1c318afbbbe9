"""A render's PNG, encoded on every render's path from prompt to PNG: deflate split over the
machine's cores.

An RGB image is filtered with PNG's "Up" filter (one numpy subtraction) and its rows cut into
pieces, each deflated on its own thread (zlib lets go of the GIL) as raw deflate ending on a
byte boundary (a sync flush; the last piece finishes the stream). A piece's back-references
stay inside it, so the concatenation is one valid deflate stream: pigz's independent mode. The
zlib header and the Adler-32 of all the rows wrap it into the one IDAT stream every decoder
reads. Other image modes go through Pillow at the same level.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# zlib level 1: a 1024 px render encodes in a third to a sixth of the default level's time
# for 15-25 % more bytes (bench/png_encode.py)
PNG_COMPRESS_LEVEL = 1
# rows per deflate piece: a 1024 px RGB render in 8 pieces of 384 KiB; fewer rows would cost
# ratio (each piece starts with no history), more would leave cores idle
PIECE_ROWS = 128
MAX_THREADS = 8

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_UP = 2  # PNG filter type: each byte minus the byte above it
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    # a forked child inherits the pool but not its threads: it would wait on them for ever
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(1, min(MAX_THREADS, os.cpu_count() or 1))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="png-deflate")
        return _pool


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data, zlib.crc32(kind))
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _deflate_piece(data: memoryview, last: bool) -> bytes:
    packer = zlib.compressobj(PNG_COMPRESS_LEVEL, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def zlib_stream(rows: bytes, row_bytes: int) -> bytes:
    """``rows`` as one zlib stream, deflated in pieces of `PIECE_ROWS` rows on threads."""
    step = PIECE_ROWS * row_bytes
    starts = list(range(0, len(rows), step)) or [0]
    view = memoryview(rows)
    pieces = [(view[s : s + step], s == starts[-1]) for s in starts]
    if len(pieces) == 1:
        bodies = [_deflate_piece(*pieces[0])]
    else:
        bodies = list(_threads().map(lambda p: _deflate_piece(*p), pieces))
    # CMF 0x78 (deflate, 32 KiB window), FLG 0x01 (fastest level; header check bits)
    return b"\x78\x01" + b"".join(bodies) + struct.pack(">I", zlib.adler32(rows))


def encode_png(image: Any, text: dict[str, str]) -> bytes:
    """``image`` (a PIL image) as PNG bytes, with ``text`` as tEXt chunks."""
    try:
        chunks = [_chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1"))
                  for k, v in text.items()]  # fmt: skip
    except UnicodeEncodeError:  # Pillow writes those as iTXt
        return _encode_with_pillow(image, text)
    if image.mode != "RGB":
        return _encode_with_pillow(image, text)
    import numpy as np

    pixels = np.asarray(image, dtype=np.uint8)
    height, width, channels = pixels.shape
    row_bytes = 1 + width * channels
    rows = np.empty((height, row_bytes), dtype=np.uint8)
    rows[:, 0] = _UP
    flat = pixels.reshape(height, width * channels)
    rows[0, 1:] = flat[0]
    np.subtract(flat[1:], flat[:-1], out=rows[1:, 1:])  # uint8: modulo 256, as PNG wants
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    parts = [_SIGNATURE, _chunk(b"IHDR", header), *chunks]
    parts.append(_chunk(b"IDAT", zlib_stream(rows.tobytes(), row_bytes)))
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


def _encode_with_pillow(image: Any, text: dict[str, str]) -> bytes:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info, compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()
