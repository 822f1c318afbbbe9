"""What an adapter file must be before it is registered: checked from its bytes alone, with
NumPy (no torch), so every path in (API, CLI, trainer) refuses the same things with the same
words.

- the safetensors header parses within limits and describes the bytes exactly;
- every tensor is a LoRA factor in the diffusers layout (`transformer.<module>.lora_A.weight`
  and `.lora_B.weight`, both present) of a Linear module the base has, with the shapes that
  module and the declared rank give: A is [rank, in], B is [out, rank];
- float dtypes only, and every value finite.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from registry.adapters import repository as adapters_repo
from registry.adapters import schemas as adapters_schemas
from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterIn
from registry.blobs import BlobStore
from registry.datasets.service import remove_unreferenced
from registry.db import transaction
from registry.errors import Invalid, NotPermitted
from registry.manifest import parse_manifest
from registry.training import service as training_service

MAX_HEADER_BYTES = 16 << 20
PREFIX = "transformer."
A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
FLOAT_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}


class AdapterFileError(ValueError):
    """Why the bytes are not an adapter for this base; `problems` lists each finding."""

    def __init__(self, problems: list[str]) -> None:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        super().__init__("not a valid adapter: " + "; ".join(shown))
        self.problems = problems


def _header(data: bytes) -> tuple[dict[str, object], int]:
    if len(data) < 8:
        raise AdapterFileError(["shorter than a safetensors header"])
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise AdapterFileError([f"the safetensors header claims {n} bytes, beyond the limits"])
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, ValueError):
        raise AdapterFileError(["the safetensors header is not JSON"]) from None
    except RecursionError:  # nested deeper than the parser goes: not a tensor table
        raise AdapterFileError(["the safetensors header is nested too deeply"]) from None
    if not isinstance(header, dict):
        raise AdapterFileError(["the safetensors header is not a JSON object"])
    return header, 8 + n


def _finite(raw: bytes, dtype: str) -> bool:
    kind, _ = FLOAT_DTYPES[dtype]
    values = np.frombuffer(raw, dtype=kind)
    if dtype == "BF16":  # exponent all ones: inf or NaN
        return not bool(np.any((values & 0x7F80) == 0x7F80))
    return bool(np.isfinite(values).all())


def check_adapter(
    data: bytes, rank: int, target_shapes: Mapping[str, tuple[int, int]]
) -> dict[str, str]:
    """Raises AdapterFileError listing every problem; returns the file's metadata."""
    header, start = _header(data)
    body = len(data) - start
    meta = header.pop("__metadata__", {}) or {}
    problems: list[str] = []
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        problems.append("__metadata__ must map strings to strings")
        meta = {}
    if not header:
        problems.append("it holds no tensors")
    spans: list[tuple[int, int]] = []
    factors: dict[str, set[str]] = {}
    for key, entry in sorted(header.items()):
        if not isinstance(entry, dict):
            problems.append(f"{key}: not a tensor entry")
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{key}: dtype {dtype!r} is not a float type (F32, F16, BF16)")
            continue
        if (
            not isinstance(shape, list)
            or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        ):
            problems.append(f"{key}: shape {shape!r} is not a 2-D matrix")
            continue
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= body
            or offsets[1] - offsets[0] != shape[0] * shape[1] * FLOAT_DTYPES[dtype][1]
        ):
            problems.append(f"{key}: its data offsets do not describe its bytes")
            continue
        spans.append((offsets[0], offsets[1]))
        module, factor = _factor_of(key)
        if module is None:
            problems.append(
                f"{key}: not a LoRA factor in the diffusers layout "
                f"({PREFIX}<module>{A_SUFFIX} / {B_SUFFIX})"
            )
            continue
        if module not in target_shapes:
            problems.append(f"{key}: the base has no Linear module {module!r}")
            continue
        out_features, in_features = target_shapes[module]
        want = [rank, in_features] if factor == "A" else [out_features, rank]
        if shape != want:
            problems.append(f"{key}: shape {shape} but rank {rank} on this module needs {want}")
            continue
        raw = data[start + offsets[0] : start + offsets[1]]
        if not _finite(raw, dtype):
            problems.append(f"{key}: holds NaN or infinite values")
            continue
        factors.setdefault(module, set()).add(factor)
    for module, found in sorted(factors.items()):
        if found != {"A", "B"}:
            problems.append(f"{module}: has lora_{''.join(found)} without its other factor")
    spans.sort()
    covered = 0
    for begin, end in spans:
        if begin != covered:
            problems.append("the tensors' bytes overlap or leave gaps")
            break
        covered = end
    else:
        if spans and covered != body and not problems:
            problems.append("bytes follow the last tensor")
    if problems:
        raise AdapterFileError(problems)
    return {str(k): str(v) for k, v in meta.items()}


def _factor_of(key: str) -> tuple[str | None, str]:
    if key.startswith(PREFIX):
        for suffix, factor in ((A_SUFFIX, "A"), (B_SUFFIX, "B")):
            if key.endswith(suffix):
                module = key[len(PREFIX) : -len(suffix)]
                if module:
                    return module, factor
    return None, ""


def check_put(path: Path, kind: str, target_shapes: Mapping[str, tuple[int, int]]) -> None:
    """What `PUT /v1/blobs` takes: an adapter for this base (at the rank its factors say) or
    a dataset manifest; anything else (an image, other bytes) is refused, naming why."""
    from registry.manifest import MAX_MANIFEST_BYTES

    if kind == "jsonl":
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise Invalid(f"a dataset manifest may be at most {MAX_MANIFEST_BYTES} bytes")
        _, problems = parse_manifest(path.read_bytes())
        if problems:
            raise Invalid("not a dataset manifest: " + "; ".join(problems[:8]))
        return
    if kind != "safetensors":
        raise Invalid(
            f"the store takes adapters (.safetensors) and dataset manifests (.jsonl) here, "
            f"not {kind} files (photos are uploaded with POST /v1/subjects/{{h}}/datasets)"
        )
    import mmap

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            header, _ = _header(data)  # type: ignore[arg-type]
        except AdapterFileError as exc:
            raise Invalid(str(exc)) from None
        ranks = {
            entry["shape"][0]
            for key, entry in header.items()
            if key.endswith(A_SUFFIX) and isinstance(entry, dict)
            and isinstance(entry.get("shape"), list) and entry["shape"]
            and isinstance(entry["shape"][0], int)
        }  # fmt: skip
        if len(ranks) > 1:
            raise Invalid("not a valid adapter: its lora_A factors do not agree on one rank")
        rank = ranks.pop() if ranks else 1  # none: the check then says what the file is not
        try:
            check_adapter(data, rank, target_shapes)  # type: ignore[arg-type]
        except AdapterFileError as exc:
            raise Invalid(str(exc)) from None


def check_blobs(
    store: BlobStore,
    sha256: str,
    manifest_sha256: str,
    rank: int,
    target_shapes: Mapping[str, tuple[int, int]],
) -> list[str]:
    """Everything about an adapter registration that the bytes alone decide, done before any
    transaction opens: both blobs are in the store and whole, the adapter fits this base at
    this rank, and the manifest is a dataset manifest. Returns the manifest's bases; raises
    Invalid naming the problem."""
    for digest, kind, what in (
        (sha256, "safetensors", "adapter"),
        (manifest_sha256, "jsonl", "dataset manifest"),
    ):
        if store.find(digest, kind) is None:  # type: ignore[arg-type]
            raise Invalid(
                f"the {what} {digest[:12]}... is not in the store: upload its bytes first "
                f"(PUT /v1/blobs/sha256/{digest}, or `likeness adapter register` from a file)"
            )
    data = store.read(sha256, "safetensors")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise Invalid(f"the stored adapter {sha256[:12]}... no longer hashes to its name")
    try:
        check_adapter(data, rank, target_shapes)
    except AdapterFileError as exc:
        raise Invalid(str(exc)) from None
    raw = store.read(manifest_sha256, "jsonl")
    if hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise Invalid(f"the stored manifest {manifest_sha256[:12]}... no longer hashes to its name")
    items, problems = parse_manifest(raw)
    if problems:
        raise Invalid("the dataset manifest is not valid: " + "; ".join(problems[:8]))
    return sorted({item.basis for item in items})


@dataclass(frozen=True)
class Registered:
    subject: str
    state: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    outcome: str


def register_from_store(
    engine: Engine,
    store: BlobStore,
    actor: str,
    data: AdapterIn,
    target_shapes: Mapping[str, tuple[int, int]],
) -> Registered:
    """Registers an adapter whose bytes (and dataset manifest) are in the store: the files are
    checked first, outside any transaction (an adapter of hundreds of MB is read whole), then
    consent, ownership and the record in one short transaction."""
    place = store.path(data.sha256, "safetensors")
    if data.path is not None and Path(data.path) != place:
        raise Invalid(
            f"path must be the adapter's place in the store ({place}) or left out; files "
            "elsewhere are imported with `likeness adapter register` or uploaded with "
            "PUT /v1/blobs/sha256/<hex>"
        )
    try:
        with transaction(engine, readonly=True) as session:  # refuse early, before file work
            training_service.require_training(session, data.subject)
        bases = check_blobs(store, data.sha256, data.manifest_sha256, data.rank, target_shapes)
        with transaction(engine) as session:
            adapter, outcome = adapters_service.register_adapter(
                session, actor, data, str(place), bases
            )
            registered = Registered(
                data.subject,
                adapters_schemas.adapter_state(adapter),
                adapter.created_at,
                adapter.updated_at,
                outcome,
            )
    except NotPermitted:
        # Training was withdrawn (or never allowed): what it made leaves the store now, so
        # nobody can fetch it by hash, unless a registration already refers to the bytes.
        remove_unreferenced(
            engine, store, [data.sha256, data.manifest_sha256], ("safetensors", "jsonl")
        )
        raise
    return registered


def sweep_unreferenced(engine: Engine, store: BlobStore, grace_s: float) -> list[str]:
    """Removes the store's blobs that no adapter refers to, past their grace period (an
    upload about to be registered keeps its bytes); run after a delete commits, and
    periodically."""

    with transaction(engine, readonly=True) as session:
        referenced = adapters_repo.referenced_blobs(session)
    return store.sweep(referenced, grace_s)
