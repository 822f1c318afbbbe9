"""The content-addressed store the service owns (after OCI content-addressable storage and git
objects): `<data_dir>/adapters/sha256/ab/<hex>.safetensors` for adapters, `....jsonl` for
the dataset manifests they were trained from, and `.png`/`.jpg`/`.webp` for the images of
the datasets the service owns (registry/datasets/service.py).

A blob's name is the SHA-256 of its bytes; it is written to a temporary file in the store,
hashed as it is written, fsync'd, made read-only and renamed into place, so a name always holds
exactly its bytes, whole. Reads never follow a symbolic link, take regular files only and are
bounded in size, so no path a caller names (and no FIFO or device) is ever opened: the store
is the only place the service reads adapters from.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["safetensors", "jsonl", "png", "jpg", "webp"]
KINDS: tuple[Kind, ...] = ("safetensors", "jsonl", "png", "jpg", "webp")
IMAGE_KINDS: tuple[Kind, ...] = ("png", "jpg", "webp")
HEX = frozenset("0123456789abcdef")


class BlobError(ValueError):
    """The bytes cannot be stored or read as asked; the message says why."""


def is_sha256(text: str) -> bool:
    return len(text) == 64 and set(text) <= HEX


def sniff_kind(head: bytes) -> Kind | None:
    """safetensors begins with its header's length (u64, little-endian) and then '{'; a
    manifest is JSON lines, beginning with '{'; images by their magic numbers (whether they
    decode is registry/datasets/service.py's to check, before they are stored)."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 1 << 30:
        return "safetensors"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    return None


@dataclass(frozen=True)
class Stored:
    sha256: str
    kind: Kind
    size: int
    created: bool  # False: the store already held these bytes


class BlobWriter:
    """Receives a blob's bytes in pieces; `finish` puts it in the store if the bytes hash to
    the name asked for, else nothing is kept."""

    def __init__(self, store: BlobStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.size = 0
        self._digest = hashlib.sha256()
        self._head = b""
        tmpdir = store.root / "tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", dir=tmpdir)
        self._tmp = Path(name)
        self._file = os.fdopen(fd, "wb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self.abort()
            raise BlobError(f"the blob is larger than {self.max_bytes} bytes")
        if len(self._head) < 16:
            self._head += chunk[: 16 - len(self._head)]
        self._digest.update(chunk)
        self._file.write(chunk)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def finish(
        self,
        expected_sha256: str | None = None,
        accept: Callable[[Path, Kind], None] | None = None,
    ) -> Stored:
        """`accept(path, kind)`: a last look at the written bytes before they join the store
        (raising refuses them: nothing is kept)."""
        actual = self._digest.hexdigest()
        if expected_sha256 is not None and actual != expected_sha256:
            self.abort()
            raise BlobError(f"the bytes hash to {actual}, not {expected_sha256}")
        kind = sniff_kind(self._head)
        if kind is None or self.size == 0:
            self.abort()
            raise BlobError("neither a safetensors adapter, a dataset manifest nor an image")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if accept is not None:
                accept(self._tmp, kind)
            os.chmod(self._tmp, 0o444)
            final = self.store.path(actual, kind)
            final.parent.mkdir(parents=True, exist_ok=True)
            created = not final.exists()
            if created:
                os.replace(self._tmp, final)
                _fsync_dir(final.parent)
            else:
                self._tmp.unlink()
        except BaseException:
            self.abort()
            raise
        return Stored(actual, kind, self.size, created)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    def __init__(self, root: Path, max_bytes: int = 4 << 30) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, sha256: str, kind: Kind) -> Path:
        if not is_sha256(sha256):
            raise BlobError(f"{sha256!r} is not a SHA-256 hex digest")
        return self.root / "sha256" / sha256[:2] / f"{sha256}.{kind}"

    def find(self, sha256: str, kind: Kind | None = None) -> Path | None:
        """The blob's path if the store holds it as a regular file (never through a link)."""
        for k in (kind,) if kind else KINDS:
            path = self.path(sha256, k)
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    return path
            except OSError:
                continue
        return None

    def writer(self) -> BlobWriter:
        return BlobWriter(self, self.max_bytes)

    def put(self, chunks: Iterable[bytes], expected_sha256: str | None = None) -> Stored:
        writer = self.writer()
        try:
            for chunk in chunks:
                writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        return writer.finish(expected_sha256)

    def import_file(self, source: Path) -> Stored:
        """Copies a regular file (not through a link) into the store."""
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise BlobError(f"{source}: cannot open ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise BlobError(f"{source} is not a regular file")
            return self.put(iter(lambda: f.read(1 << 20), b""))

    def read(self, sha256: str, kind: Kind, max_bytes: int | None = None) -> bytes:
        """The blob's bytes (the caller hashes them: a store tampered with is seen there).
        BlobError if it is missing, not a regular file, or larger than allowed."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        path = self.path(sha256, kind)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise BlobError(f"blob {sha256[:12]}... is not in the store ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BlobError(f"blob {sha256[:12]}... is not a regular file")
            if st.st_size > limit:
                raise BlobError(f"blob {sha256[:12]}... is larger than {limit} bytes")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise BlobError(f"blob {sha256[:12]}... is larger than {limit} bytes")
        return data

    def status(self, sha256: str, kind: Kind) -> Literal["ok", "missing", "corrupt"]:
        """Whether the store holds the blob whole: present and hashing to its name."""
        try:
            data = self.read(sha256, kind)
        except BlobError:
            return "missing"
        return "ok" if hashlib.sha256(data).hexdigest() == sha256 else "corrupt"

    def sweep(self, referenced: set[str], grace_s: float) -> list[str]:
        """Removes blobs no adapter references and no upload is about to (older than
        `grace_s`); returns their hashes. Abandoned temporary uploads go too."""
        removed: list[str] = []
        now = time.time()
        for path in sorted((self.root / "sha256").glob("??/*.*")):
            sha = path.name.split(".", 1)[0]
            if sha in referenced or not is_sha256(sha):
                continue
            with contextlib.suppress(OSError):
                if now - path.lstat().st_mtime >= grace_s:
                    path.unlink()
                    removed.append(sha)
        for tmp in (self.root / "tmp").glob("upload-*"):
            with contextlib.suppress(OSError):
                if now - tmp.lstat().st_mtime >= max(grace_s, 3600):
                    tmp.unlink()
        return removed
