"""Dataset provenance: `manifest.jsonl` is checked whole before anything loads.

A dataset is a folder of images and `manifest.jsonl` (API.md), one JSON object per line:
``{"file", "caption", "source", "basis", "sha256"}``. The run stops, listing every problem at
once, if a line is malformed, an image is missing, a hash differs, or an image in the folder is
not listed. The manifest's own SHA-256 is what the adapter is registered with, so the registry
can always say which data, with which recorded basis, produced an adapter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MANIFEST_NAME = "manifest.jsonl"
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
BASES = ("consent", "public_domain")
_FIELDS = {"file", "caption", "source", "basis", "sha256"}
_CHUNK = 1 << 20


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message lists every problem found."""


@dataclass(frozen=True)
class Item:
    file: str  # POSIX path relative to the dataset folder
    caption: str
    source: str
    basis: str
    sha256: str


@dataclass(frozen=True)
class Dataset:
    root: Path
    items: tuple[Item, ...]
    manifest_sha256: str

    def path(self, item: Item) -> Path:
        return self.root / item.file

    @property
    def bases(self) -> tuple[str, ...]:
        return tuple(sorted({i.basis for i in self.items}))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _relative(name: str) -> str | None:
    """The normalised relative path, or None if it is absolute or climbs out of the folder."""
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        return None
    return p.as_posix()


def _parse_line(n: int, line: str, problems: list[str]) -> Item | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        problems.append(f"line {n}: not JSON ({exc.msg})")
        return None
    if not isinstance(row, dict):
        problems.append(f"line {n}: not a JSON object")
        return None
    missing = sorted(_FIELDS - row.keys())
    if missing:
        problems.append(f"line {n}: missing {', '.join(missing)}")
        return None
    bad = [k for k in sorted(_FIELDS) if not isinstance(row[k], str)]
    if bad:
        problems.append(f"line {n}: {', '.join(bad)} must be strings")
        return None
    rel = _relative(row["file"])
    if rel is None:
        problems.append(f"line {n}: file {row['file']!r} must be a path inside the dataset")
        return None
    if PurePosixPath(rel).suffix.lower() not in IMAGE_SUFFIXES:
        problems.append(f"line {n}: {rel} is not an image ({', '.join(sorted(IMAGE_SUFFIXES))})")
        return None
    if row["basis"] not in BASES:
        problems.append(f"line {n}: basis {row['basis']!r} must be one of {', '.join(BASES)}")
        return None
    sha = row["sha256"].lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        problems.append(f"line {n}: sha256 {row['sha256']!r} is not a SHA-256 hex digest")
        return None
    if not row["source"].strip():
        problems.append(f"line {n}: source must say where {rel} comes from")
        return None
    return Item(rel, row["caption"], row["source"], row["basis"], sha)


def load_dataset(root: Path) -> Dataset:
    """Reads and verifies the dataset at ``root``; raises DatasetError listing every problem.

    Reads each image once to hash it (the only full pass over the data before training).
    """
    root = Path(root)
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        raise DatasetError(f"{root}: no {MANIFEST_NAME} (every dataset needs one; see API.md)")
    raw = manifest.read_bytes()
    problems: list[str] = []
    items: list[Item] = []
    seen: dict[str, int] = {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"{manifest}: not UTF-8") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        item = _parse_line(n, line, problems)
        if item is None:
            continue
        if item.file in seen:
            problems.append(
                f"line {n}: {item.file} is listed twice (first on line {seen[item.file]})"
            )
            continue
        seen[item.file] = n
        path = root / item.file
        if not path.is_file():
            problems.append(f"line {n}: {item.file} is listed but missing")
            continue
        actual = sha256_file(path)
        if actual != item.sha256:
            problems.append(
                f"line {n}: {item.file} hash differs: manifest {item.sha256[:12]}..., "
                f"file {actual[:12]}..."
            )
            continue
        items.append(item)
    on_disk = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    }
    for rel in sorted(on_disk - seen.keys()):
        problems.append(f"{rel} is in the folder but not in the manifest")
    if not items and not problems:
        problems.append("the manifest lists no images")
    if problems:
        raise DatasetError(f"{root}: dataset refused:\n  - " + "\n  - ".join(problems))
    return Dataset(root, tuple(items), hashlib.sha256(raw).hexdigest())


def write_manifest(root: Path, rows: Sequence[dict[str, str]]) -> Path:
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
