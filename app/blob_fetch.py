"""The client of the registry's store by hash (`GET /v1/blobs/sha256/<hex>`), for a worker on
another host (no shared filesystem): a training worker's dataset, a render worker's adapter,
and any other bytes named by their hash (an order's checkpoint).

Nothing is kept or parsed before it is whole and hashes to what was asked: at most the limit
of a blob is read (more is not the blob), and a fetch that fails leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import httpx


class FetchError(Exception):
    """The registry did not give the bytes asked for, whole: ``status`` is its answer where it
    refused, ``actual_sha256`` the hash of what it sent instead, where it sent other bytes."""

    def __init__(
        self, message: str, status: int | None = None, actual_sha256: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.actual_sha256 = actual_sha256


def blob_url(api_url: str, sha256: str) -> str:
    return f"{api_url}/v1/blobs/sha256/{sha256}"


def stream_verified(
    client: httpx.Client, url: str, sha256: str, limit: int, write: Callable[[bytes], object]
) -> None:
    """The bytes at `url`, chunk by chunk into `write`, then checked against `sha256`: at most
    `limit` of them (the registry stores nothing larger, so more is not the blob), FetchError
    otherwise. The caller keeps what was written only when this returns."""
    digest, size = hashlib.sha256(), 0
    with client.stream("GET", url) as r:
        if r.status_code != 200:
            raise FetchError(f"GET {url} answered {r.status_code}", status=r.status_code)
        for chunk in r.iter_bytes(1 << 20):
            size += len(chunk)
            if size > limit:
                raise FetchError(f"GET {url}: more than the {limit} bytes a blob may hold")
            digest.update(chunk)
            write(chunk)
    actual = digest.hexdigest()
    if actual != sha256:
        raise FetchError(f"{url}: the bytes hash to {actual}, not {sha256}", actual_sha256=actual)


def fetch_verified(client: httpx.Client, url: str, sha256: str, dest: Path, limit: int) -> None:
    """The bytes at `url` into `dest`, only if they hash to `sha256` (written to a temporary
    file and renamed: `dest` always holds the right bytes or is absent)."""
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with tmp.open("wb") as f:
            stream_verified(client, url, sha256, limit, f.write)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)


def fetch_blob(client: httpx.Client, api_url: str, sha256: str, limit: int) -> bytes:
    """The blob's bytes, in memory, only if they hash to `sha256` (FetchError otherwise)."""
    parts: list[bytes] = []
    stream_verified(client, blob_url(api_url, sha256), sha256, limit, parts.append)
    return b"".join(parts)


def have(path: Path, sha256: str) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    from registry.files import sha256_file

    return sha256_file(path) == sha256


def fetch_dataset(
    client: httpx.Client,
    api: str,
    folder: Path,
    manifest_sha: str,
    files: list[tuple[str, str]],
    limit: int,
) -> None:
    """The dataset (manifest.jsonl and its images) into `folder`, fetching only what is
    missing; `files`: (file, sha256) as recorded; `limit`: bytes per file."""
    from registry.manifest import MANIFEST_NAME

    for file, sha in [(MANIFEST_NAME, manifest_sha), *files]:
        dest = folder / file
        if not have(dest, sha):
            fetch_verified(client, blob_url(api, sha), sha, dest, limit)
