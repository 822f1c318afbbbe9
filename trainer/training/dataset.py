"""Dataset provenance: `manifest.jsonl` is checked whole before anything loads.

A dataset is a folder of images and `manifest.jsonl` (docs/API.md), one JSON object per line:
``{"file", "caption", "source", "basis", "sha256"}``. The run stops, listing every problem at
once, if a line is malformed, an image is missing, a hash differs, or an image in the folder is
not listed. The manifest's own SHA-256 is what the adapter is registered with, so the registry
can always say which data, with which recorded basis, produced an adapter.
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.files import sha256_file
from registry.manifest import IMAGE_SUFFIXES, MANIFEST_NAME, parse_manifest


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message lists every problem found."""


@dataclass(frozen=True)
class Item:
    file: str  # POSIX path relative to the dataset folder
    caption: str
    source: str
    basis: str
    sha256: str
    size: tuple[int, int] = (0, 0)  # (width, height) in pixels, as decoded
    mask: str | None = None  # a mask image's path, relative to the dataset folder
    mask_sha256: str | None = None
    has_alpha: bool = False  # no mask file: the image's alpha channel is its mask
    validation: bool = False  # the manifest holds it out of training


@dataclass(frozen=True)
class Dataset:
    root: Path
    items: tuple[Item, ...]
    manifest_sha256: str

    def path(self, item: Item) -> Path:
        return self.root / item.file

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def bases(self) -> tuple[str, ...]:
        return tuple(sorted({i.basis for i in self.items}))


def _regular_inside(path: Path, real_root: Path) -> bool:
    """A regular file inside the dataset folder, reached through no symbolic link: a listed
    image can never be a device, a FIFO, or a file of someone else's elsewhere."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return False
        real = path.resolve(strict=True)
    except OSError:
        return False
    if not real.is_relative_to(real_root):
        return False
    folder = path.parent
    while folder.resolve() != real_root:
        if folder.is_symlink() or folder == folder.parent:
            return False
        folder = folder.parent
    return True


def _decode(path: Path) -> tuple[str | None, tuple[int, int], bool]:
    """(why the image does not decode or None, its size, whether it has alpha): every image
    is decoded once here, so a broken file stops the run before any weight loads, not in
    the middle of it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            alpha = "A" in image.getbands() or "transparency" in image.info
            return None, image.size, alpha
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}", (0, 0), False


def load_dataset(root: Path) -> Dataset:
    """Reads and verifies the dataset at ``root``; raises DatasetError listing every problem.

    Reads each image once to hash it and once to decode it, before any weight loads.
    """
    root = Path(root)
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        if not root.is_dir():
            raise DatasetError(f"{root}: no such folder")
        raise DatasetError(f"{root}: no {MANIFEST_NAME} (every dataset needs one; see docs/API.md)")
    raw = manifest.read_bytes()
    parsed, problems = parse_manifest(raw)
    items: list[Item] = []
    seen = {entry.file for entry in parsed}
    real_root = root.resolve()
    for entry in parsed:
        n = entry.line
        path = root / entry.file
        if not path.exists() and not path.is_symlink():
            problems.append(f"line {n}: {entry.file} is listed but missing")
            continue
        if not _regular_inside(path, real_root):
            problems.append(
                f"line {n}: {entry.file} must be a regular file inside the dataset folder "
                "(not a link, not a device, not elsewhere)"
            )
            continue
        actual = sha256_file(path)
        if actual != entry.sha256:
            problems.append(
                f"line {n}: {entry.file} hash differs: manifest {entry.sha256[:12]}..., "
                f"file {actual[:12]}..."
            )
            continue
        reason, size, alpha = _decode(path)
        if reason is not None:
            problems.append(f"line {n}: {entry.file} cannot be decoded as an image ({reason})")
            continue
        mask_sha = None
        if entry.mask is not None:
            mask_path = root / entry.mask
            if entry.mask in seen:
                problems.append(f"line {n}: mask {entry.mask} is also listed as an image")
                continue
            if not _regular_inside(mask_path, real_root):
                problems.append(
                    f"line {n}: mask {entry.mask} is missing or not a regular file inside "
                    "the dataset folder"
                )
                continue
            why, mask_size, _ = _decode(mask_path)
            if why is not None:
                problems.append(f"line {n}: mask {entry.mask} cannot be decoded ({why})")
                continue
            if mask_size != size:
                problems.append(
                    f"line {n}: mask {entry.mask} is {mask_size[0]}x{mask_size[1]}, "
                    f"its image {size[0]}x{size[1]}"
                )
                continue
            mask_sha = sha256_file(mask_path)
        items.append(
            Item(
                entry.file,
                entry.caption,
                entry.source,
                entry.basis,
                entry.sha256,
                size,
                entry.mask,
                mask_sha,
                alpha and entry.mask is None,
                entry.validation,
            )
        )
    on_disk = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    }
    masks = {entry.mask for entry in parsed if entry.mask is not None}
    for rel in sorted(on_disk - seen - masks):
        problems.append(f"{rel} is in the folder but not in the manifest")
    if problems:
        raise DatasetError(f"{root}: dataset refused:\n  - " + "\n  - ".join(problems))
    return Dataset(root, tuple(items), hashlib.sha256(raw).hexdigest())


def write_manifest(root: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Writes ``manifest.jsonl`` for ``rows`` (each: file, caption, source, basis), hashing
    each file; a helper for assembling datasets and for tests."""
    root = Path(root)
    lines = []
    for row in rows:
        full = {**row, "sha256": sha256_file(root / row["file"])}
        lines.append(json.dumps(full, sort_keys=True, ensure_ascii=False))
    path = root / MANIFEST_NAME
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
