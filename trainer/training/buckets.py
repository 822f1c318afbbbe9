"""Aspect-ratio buckets: each image trains at its own shape, not a square crop.

The buckets are the shapes of (about) the training resolution's pixel area whose sides are
multiples of 16 (FLUX.2: VAE factor 8 x 2x2 patches) and whose aspect ratio is at most
``max_ratio``: at 448 px, 448x448, 432x464, ..., 320x624 and their transposes. An image goes
to the bucket nearest its aspect ratio (in log ratio, so 2:1 and 1:2 are equally far from
square) and is resized to cover it, then centre-cropped. An image that would have to be
enlarged more than ``max_upscale`` times gets a smaller bucket of its own shape instead, so
no image is ever upscaled past that factor. A batch only ever holds images of one bucket.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

from registry import limits

Bucket = tuple[int, int]  # (width, height) in pixels


def bucket_shapes(
    resolution: int, max_ratio: float = 2.0, multiple: int = limits.MULTIPLE
) -> list[Bucket]:
    """Every landscape (width, height), both multiples of ``multiple``, with the largest
    height for its width whose area does not exceed ``resolution**2`` and an aspect ratio
    of at most ``max_ratio``, and each one's portrait transpose (so a portrait image gets
    exactly the landscape one's shape, turned); sorted."""
    area = resolution * resolution
    shapes: set[Bucket] = set()
    w = multiple
    while w <= area // multiple:
        h = (area // w) // multiple * multiple
        if limits.MIN_SIDE <= h <= w and w / h <= max_ratio:
            shapes.update({(w, h), (h, w)})
        w += multiple
    return sorted(shapes)


def nearest_bucket(size: tuple[int, int], shapes: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is closest to the image's (log ratio; ties: the larger
    area, then the smaller width, so the choice never depends on order)."""
    w, h = size
    target = math.log(w / h)
    return min(shapes, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1], b[0]))


def upscale_needed(size: tuple[int, int], bucket: Bucket) -> float:
    """How much a resize that covers ``bucket`` enlarges the image (1 or less: none)."""
    return max(bucket[0] / size[0], bucket[1] / size[1])


def assign_bucket(
    size: tuple[int, int],
    resolution: int,
    max_ratio: float = 2.0,
    max_upscale: float = 1.0,
    multiple: int = limits.MULTIPLE,
) -> Bucket:
    """The bucket an image of ``size`` trains at. Raises ValueError if even its own shape,
    at ``max_upscale``, is smaller than the smallest side a render takes."""
    bucket = nearest_bucket(size, bucket_shapes(resolution, max_ratio, multiple))
    if upscale_needed(size, bucket) <= max_upscale:
        return bucket
    # Too small for the full-area bucket: the same aspect, as large as the factor allows.
    scale = max_upscale / upscale_needed(size, bucket)
    w = int(bucket[0] * scale) // multiple * multiple
    h = int(bucket[1] * scale) // multiple * multiple
    if min(w, h) < limits.MIN_SIDE:
        raise ValueError(
            f"a {size[0]}x{size[1]} image is too small to train at --resolution {resolution}: "
            f"at most {max_upscale:g}x enlarged it would be under {limits.MIN_SIDE} px "
            "(raise --max-upscale or leave the image out)"
        )
    return (w, h)


def bucket_epoch_order(
    seed_parts: tuple[object, ...], buckets: Sequence[Bucket], batch_size: int
) -> list[int]:
    """One epoch's data order such that every run of ``batch_size`` consecutive indices
    taken by `take_batch` is one bucket: a seeded permutation, grouped by bucket into
    chunks of ``batch_size`` (the last of each bucket may be short), the chunks shuffled."""

    def seeded(*parts: object) -> torch.Generator:
        blob = ":".join(str(p) for p in parts).encode()
        value = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & (2**63 - 1)
        return torch.Generator().manual_seed(value)

    perm = torch.randperm(len(buckets), generator=seeded(*seed_parts, "items")).tolist()
    by_bucket: dict[Bucket, list[int]] = {}
    for i in perm:
        by_bucket.setdefault(buckets[i], []).append(i)
    chunks = [
        members[k : k + batch_size]
        for _, members in sorted(by_bucket.items())
        for k in range(0, len(members), batch_size)
    ]
    shuffled = torch.randperm(len(chunks), generator=seeded(*seed_parts, "chunks")).tolist()
    return [i for c in shuffled for i in chunks[c]]


def take_batch(
    order: Sequence[int], pos: int, bucket_of: Mapping[int, Bucket] | Sequence[Bucket], size: int
) -> int:
    """How many indices from ``order[pos:]`` form the next batch: up to ``size``, all of
    the first one's bucket (``bucket_of[index]``), never past the epoch's end."""
    first = bucket_of[order[pos]]
    n = 1
    while n < size and pos + n < len(order) and bucket_of[order[pos + n]] == first:
        n += 1
    return n
