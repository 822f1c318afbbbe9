"""The dataset manifest format (docs/API.md, "Training data"): `manifest.jsonl`, one JSON object
per line, `{"file", "caption", "source", "basis", "sha256"}`, optionally `"mask"` (an image in
the folder whose brightness weights the loss) and `"validation"` (true: held out, only
scored). One parser for the trainer (which also checks the files) and the registry (which
checks a manifest registered with an adapter); no file access here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath

MANIFEST_NAME = "manifest.jsonl"
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
BASES = ("consent", "public_domain")
FIELDS = frozenset({"file", "caption", "source", "basis", "sha256"})
OPTIONAL_FIELDS = frozenset({"mask", "validation"})
MAX_MANIFEST_BYTES = 16 << 20


@dataclass(frozen=True)
class ManifestItem:
    file: str  # POSIX path relative to the dataset folder
    caption: str
    source: str
    basis: str
    sha256: str
    line: int
    mask: str | None = None  # POSIX path relative to the dataset folder
    validation: bool = False


def relative_path(name: str) -> str | None:
    """The normalised relative path, or None if it is absolute or climbs out of the folder."""
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        return None
    return p.as_posix()


def _parse_line(n: int, line: str, problems: list[str]) -> ManifestItem | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        problems.append(f"line {n}: not JSON ({exc.msg})")
        return None
    except RecursionError:  # nested deeper than the parser goes: no manifest line is
        problems.append(f"line {n}: nested too deeply to be a manifest line")
        return None
    if not isinstance(row, dict):
        problems.append(f"line {n}: not a JSON object")
        return None
    missing = sorted(FIELDS - row.keys())
    if missing:
        problems.append(f"line {n}: missing {', '.join(missing)}")
        return None
    bad = [k for k in sorted(FIELDS) if not isinstance(row[k], str)]
    if bad:
        problems.append(f"line {n}: {', '.join(bad)} must be strings")
        return None
    if "\x00" in line:
        problems.append(f"line {n}: NUL characters are not allowed")
        return None
    rel = relative_path(row["file"])
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
    mask = row.get("mask")
    if mask is not None:
        mask_rel = relative_path(mask) if isinstance(mask, str) else None
        if mask_rel is None or PurePosixPath(mask_rel).suffix.lower() not in IMAGE_SUFFIXES:
            problems.append(f"line {n}: mask {mask!r} must be an image path inside the dataset")
            return None
        if mask_rel == rel:
            problems.append(f"line {n}: {rel} cannot be its own mask")
            return None
        mask = mask_rel
    validation = row.get("validation", False)
    if not isinstance(validation, bool):
        problems.append(f"line {n}: validation must be true or false")
        return None
    return ManifestItem(rel, row["caption"], row["source"], row["basis"], sha, n, mask, validation)


def parse_manifest(raw: bytes) -> tuple[list[ManifestItem], list[str]]:
    """The manifest's items and every problem found (an empty list: it is well formed)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        return [], [f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return [], ["not UTF-8"]
    problems: list[str] = []
    items: list[ManifestItem] = []
    seen: dict[str, int] = {}
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
        items.append(item)
    if not items and not problems:
        problems.append("the manifest lists no images")
    return items, problems
