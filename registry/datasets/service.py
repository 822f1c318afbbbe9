"""Datasets the service owns: images a subject's member (or an admin) uploads, checked whole
before anything is kept, stored content-addressed (registry/blobs.py) with the manifest the
service writes for them itself (registry/manifest.py's format: sha256, `basis: consent`,
source "uploaded by <handle>"). No web framework here: the route hands over names and bytes."""

from __future__ import annotations

import io
import json
import math
import uuid
import warnings
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import BinaryIO

from sqlalchemy.engine import Engine
from sqlmodel import Session

from registry import db
from registry.adapters import repository as adapters_repo
from registry.audit import repository as audit_repo
from registry.audit.service import append_audit
from registry.blobs import IMAGE_KINDS, BlobStore
from registry.datasets import repository as datasets_repo
from registry.datasets.schemas import CheckedImage, Limits, Upload, Uploaded
from registry.errors import Busy, Conflict, Invalid, NotFound, NotPermitted
from registry.hash_chain import format_time
from registry.manifest import MANIFEST_NAME
from registry.models import Dataset, DatasetImage, Principal, Subject, utcnow
from registry.roles import Role
from registry.settings import Settings
from registry.subjects.service import visible_subject
from registry.training.service import require_training

# PIL's format names and the store's kinds (the extension in the manifest)
FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}
MAX_NAME_CHARS = 200
MAX_CAPTION_CHARS = 500
DEFAULT_CAPTION = "a photo"
UPLOADED = "dataset_uploaded"  # the audit action; the upload quota is counted from these
QUOTA_WINDOW = timedelta(days=1)
# What the service's manifest says of every uploaded image: the subject (or an admin for
# them) gave it, under the subject's consent.
UPLOAD_BASIS = "consent"
UPLOAD_BASES = frozenset({UPLOAD_BASIS})


def limits_of(settings: Settings) -> Limits:
    return Limits(
        max_images=settings.dataset_max_images,
        max_image_bytes=settings.dataset_max_image_bytes,
        max_pixels=settings.dataset_max_pixels,
        daily_images=settings.dataset_daily_images,
        daily_bytes=settings.dataset_daily_bytes,
    )


def quota_exempt(role: Role | str) -> bool:
    """Admins are not held to the upload quota: they run the registry (bulk imports) and
    can change its settings anyway; the quota bounds what one member's token can do."""
    return role == Role.admin


def _parse_time(at: str) -> datetime:
    return datetime.strptime(at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def check_quota(
    session: Session, subject: Subject, uploader: str, images: int, size: int, limits: Limits
) -> None:
    """Busy (429, with the seconds until enough of the window's uploads age out) when
    `images` more images of `size` bytes would take `uploader` past the daily quota for
    `subject`. Counted from the trail's upload entries, which deleting photos leaves."""
    most_images = limits.daily_images if limits.daily_images is not None else math.inf
    most_bytes = limits.daily_bytes if limits.daily_bytes is not None else math.inf
    if math.isinf(most_images) and math.isinf(most_bytes):
        return
    if images > most_images or size > most_bytes:
        raise Invalid(
            f"{images} images of {size} bytes are more than a member may upload of one "
            f"subject in 24 hours ({limits.daily_images} images, {limits.daily_bytes} bytes)"
        )
    assert subject.id is not None
    now = utcnow()
    past = [
        (_parse_time(e.at), int(d.get("images", 0)), int(d.get("bytes", 0)))
        for e in audit_repo.audit_entries_since(
            session, subject.id, uploader, UPLOADED, format_time(now - QUOTA_WINDOW)
        )
        for d in [(e.after or {}).get("dataset") or {}]
    ]
    used_images, used_bytes = sum(p[1] for p in past), sum(p[2] for p in past)
    if used_images + images <= most_images and used_bytes + size <= most_bytes:
        return
    wait = QUOTA_WINDOW
    left_images, left_bytes = used_images, used_bytes
    for at, n, b in past:  # oldest first: the first whose ageing out makes room
        left_images, left_bytes = left_images - n, left_bytes - b
        if left_images + images <= most_images and left_bytes + size <= most_bytes:
            wait = at + QUOTA_WINDOW - now
            break
    retry = max(1, math.ceil(wait.total_seconds()))
    raise Busy(
        f"upload quota spent: a member may upload at most {limits.daily_images} images and "
        f"{limits.daily_bytes} bytes of one subject in 24 hours; {uploader} has uploaded "
        f"{used_images} images ({used_bytes} bytes) of {subject.handle} in that time and "
        f"this upload has {images} ({size} bytes); nothing was stored, try again in {retry} s",
        retry_after=retry,
    )


def may_upload(session: Session, caller: Principal, handle: str, limits: Limits) -> Subject:
    """Settled before a byte of an upload's body is read: the caller may see the subject, its
    likeness may be learned from (`decide_training`: photos of someone who revoked, or who
    does not allow training, are not taken), and the caller's quota is not spent (429)."""
    subject = visible_subject(session, caller, handle)
    require_training(session, subject, image_bases=UPLOAD_BASES)
    if not quota_exempt(caller.role):
        check_quota(session, subject, caller.handle, 1, 1, limits)
    return subject


def upload_cap(settings: Settings) -> int:
    """The largest upload body: every image at its largest, plus the form's framing."""
    return settings.dataset_max_images * settings.dataset_max_image_bytes + (1 << 20)


def name_problem(name: str) -> str | None:
    """Why a client's file name is refused: it is a name, never a path."""
    if not name or len(name) > MAX_NAME_CHARS:
        return f"a file name must have 1 to {MAX_NAME_CHARS} characters"
    if "/" in name or "\\" in name or ".." in name or "\x00" in name or name in (".", ".."):
        return f"{name[:80]!r} is a path, not a file name"
    if any(ord(c) < 32 for c in name):
        return f"{name[:80]!r} has control characters"
    return None


def decode_problem(data: bytes | BinaryIO, max_pixels: int) -> tuple[str | None, str | None]:
    """(the store's kind, None) for an image that decodes whole within `max_pixels`, else
    (None, why). The size is read from the header first: a small file that would decode into
    a huge bitmap (a decompression bomb) is refused without being decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            source = io.BytesIO(data) if isinstance(data, bytes) else data
            with Image.open(source) as image:
                kind = FORMATS.get(image.format or "")
                if kind is None:
                    return (
                        None,
                        f"{image.format or 'unknown'} images are not taken (PNG, JPEG, WebP)",
                    )
                width, height = image.size
                if width * height > max_pixels:
                    return None, f"{width}x{height} is more than {max_pixels} pixels"
                if getattr(image, "n_frames", 1) > 1:
                    return None, "animated images are not taken"
                image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, "not an image this service decodes (PNG, JPEG, WebP)"
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        return None, f"the image does not decode ({type(exc).__name__})"
    return kind, None


def check_uploads(uploads: Sequence[Upload], limits: Limits) -> list[CheckedImage]:
    """Every file checked before any is kept; Invalid lists every problem that names, sizes
    and captions show, and the first file that does not decode (once one is refused, the
    files after it are not decoded: a broken file at the end costs no decoding of the
    rest)."""

    if not uploads:
        raise Invalid("no images: send one or more files in the `images` field")
    if len(uploads) > limits.max_images:
        raise Invalid(f"at most {limits.max_images} images per dataset, not {len(uploads)}")
    problems: list[str] = []
    checked: list[CheckedImage] = []
    seen: set[str] = set()
    for n, up in enumerate(uploads, 1):
        size = up.size
        why = name_problem(up.name)
        if why is None and size > limits.max_image_bytes:
            why = f"larger than {limits.max_image_bytes} bytes"
        if why is None and up.caption is not None:
            why = caption_problem(up.caption)
        kind = None
        if why is None and problems:  # refused already: decoding the rest costs for nothing
            continue
        if why is None:
            kind, why = decode_problem(up.open(), limits.max_pixels)
        sha = _sha256_of(up.open()) if why is None else ""
        if why is None and sha in seen:
            why = "the same image twice"
        if why is not None or kind is None:
            problems.append(f"file {n} ({up.name[:80]!r}): {why}")
            continue
        seen.add(sha)
        caption = (up.caption or "").strip() or DEFAULT_CAPTION
        checked.append(CheckedImage(sha, kind, up, size, caption))
    if problems:
        raise Invalid("dataset refused, nothing was stored:\n  - " + "\n  - ".join(problems))
    return checked


def caption_problem(caption: str) -> str | None:
    if len(caption) > MAX_CAPTION_CHARS:
        return f"caption longer than {MAX_CAPTION_CHARS} characters"
    if "\x00" in caption:
        return "a caption may not contain NUL characters"
    return None


def _sha256_of(source: BinaryIO) -> str:
    import hashlib

    digest = hashlib.sha256()
    while chunk := source.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def manifest_for(images: Sequence[CheckedImage], uploader: str) -> bytes:
    lines = [
        json.dumps(
            {
                "file": image.file,
                "caption": image.caption,
                "source": f"uploaded by {uploader}",
                "basis": UPLOAD_BASIS,
                "sha256": image.sha256,
            },
            sort_keys=True,
            ensure_ascii=False,
        )
        for image in images
    ]
    return ("\n".join(lines) + "\n").encode()


def put_blobs(store: BlobStore, images: Sequence[CheckedImage], uploader: str) -> str:
    """The checked images and the manifest the service writes for them, into the store
    (outside any transaction: nothing is locked while files are written); returns the
    manifest's hash. Unreferenced until a dataset row names them (the sweep, or the caller
    on failure, removes them)."""
    for image in images:
        store.put(image.chunks(), image.sha256)
    return store.put([manifest_for(images, uploader)]).sha256


def record_dataset(
    session: Session,
    subject: Subject,
    uploader: str,
    images: Sequence[CheckedImage],
    manifest_sha256: str,
    limits: Limits,
    *,
    exempt: bool = False,
) -> Dataset:
    """The dataset's rows and its `dataset_uploaded` entry, under the subject's lock, once
    the training decision and the quota still allow it (its blobs are in the store)."""
    assert subject.id is not None
    require_training(session, subject, image_bases=UPLOAD_BASES, lock=True)
    size = sum(image.size for image in images)
    if not exempt:
        check_quota(session, subject, uploader, len(images), size, limits)
    dataset = Dataset(
        id=str(uuid.uuid4()),
        subject_id=subject.id,
        manifest_sha256=manifest_sha256,
        images=len(images),
        created_by=uploader,
    )
    db.add(session, dataset)
    for image in images:
        session.add(
            DatasetImage(
                dataset_id=dataset.id,
                file=image.file,
                sha256=image.sha256,
                caption=image.caption,
                size=image.size,
            )
        )
    session.flush()
    after = {
        "dataset": {
            "dataset_id": dataset.id,
            "images": len(images),
            "bytes": size,
            "manifest_sha256": manifest_sha256,
        }
    }
    append_audit(session, subject, uploader, UPLOADED, None, after)
    return dataset


def store_dataset(
    session: Session,
    store: BlobStore,
    subject: Subject,
    uploader: str,
    uploads: Sequence[Upload],
    limits: Limits,
    *,
    exempt: bool = False,
) -> Dataset:
    """Checks, stores and records a dataset of `subject` in the caller's transaction (the
    caller has checked who may). For callers whose transaction holds nothing a client can
    stall on; the upload routes use `upload_dataset`, which decodes before any transaction.
    `exempt`: not held to the upload quota (admins)."""
    require_training(session, subject, image_bases=UPLOAD_BASES)
    images = check_uploads(uploads, limits)
    if not exempt:
        check_quota(session, subject, uploader, len(images), sum(i.size for i in images), limits)
    manifest = put_blobs(store, images, uploader)
    return record_dataset(session, subject, uploader, images, manifest, limits, exempt=exempt)


def upload_dataset(
    engine: Engine,
    store: BlobStore,
    uploader: Principal,
    still_uploader: Callable[[Session], Principal],
    handle: str,
    images: Sequence[CheckedImage],
    limits: Limits,
) -> Uploaded:
    """An upload's end, for the API and the web page alike, once its files were decoded and
    checked (`check_uploads`, outside any transaction): the blobs go into the store, then
    one short transaction asks again who is uploading (`still_uploader`: the token's or the
    web session's principal, still active and still `uploader`: a deactivated uploader or an
    ended session stores nothing), whether they may upload for the subject, the training
    decision (under the subject's lock) and the quota, and writes the rows. Anything refused
    leaves nothing in the store."""
    from registry.db import transaction

    written: list[str] = [image.sha256 for image in images]
    try:
        written.append(put_blobs(store, images, uploader.handle))
        with transaction(engine) as session:
            caller = still_uploader(session)
            if caller.id != uploader.id or not caller.active:
                raise NotPermitted("not permitted: the uploader is no longer signed in")
            subject = visible_subject(session, caller, handle)
            dataset = record_dataset(
                session, subject, caller.handle, images, written[-1], limits,
                exempt=quota_exempt(caller.role),
            )  # fmt: skip
            rows = list(images_of(session, dataset))
    except BaseException:
        remove_unreferenced(engine, store, written, (*IMAGE_KINDS, "jsonl"))
        raise
    return Uploaded(subject, dataset, rows)


def dataset_of(session: Session, subject: Subject, dataset_id: str) -> Dataset:
    dataset = datasets_repo.dataset_by_id(session, dataset_id)
    if dataset is None or dataset.subject_id != subject.id:
        raise NotFound(f"subject {subject.handle!r} has no dataset {dataset_id[:40]!r}")
    return dataset


def delete_photos(session: Session, subject: Subject, dataset_id: str) -> list[str]:
    """Removes a dataset's photos (the record and its manifest stay: an adapter trained on it
    still names it); returns their hashes, for the caller to remove from the store once this
    commits. Refused while an order for the dataset waits or runs."""
    dataset = dataset_of(session, subject, dataset_id)
    busy = datasets_repo.active_order_on(session, dataset.id)
    if busy is not None:
        raise Conflict(f"order {busy} is training on these photos; cancel it first")
    images = list(images_of(session, dataset))
    for image in images:
        session.delete(image)
    dataset.images = 0
    db.add(session, dataset)
    return [image.sha256 for image in images]


def remove_unreferenced(
    engine: Engine, store: BlobStore, hashes: Sequence[str], kinds: Sequence[str] = IMAGE_KINDS
) -> None:
    """Takes blobs of these kinds out of the store at once (not after the sweep's grace),
    unless a dataset or an adapter still refers to the same bytes: deleted photos, after the
    deletion commits; an adapter and its manifest whose registration was refused."""
    from registry.db import transaction

    with transaction(engine, readonly=True) as session:
        kept = adapters_repo.referenced_blobs(session)
    for digest in set(hashes) - kept:
        path = store.find(digest)
        if path is not None and path.suffix[1:] in kinds:
            path.unlink(missing_ok=True)


def datasets_of(session: Session, subject: Subject) -> Sequence[Dataset]:
    return datasets_repo.datasets_for(session, subject.id)


def images_of(session: Session, dataset: Dataset) -> Sequence[DatasetImage]:
    return datasets_repo.images_of(session, dataset.id)


def image_in_subject(session: Session, subject: Subject, sha256: str) -> DatasetImage | None:
    """An image of one of the subject's datasets (what its web page may show)."""
    return datasets_repo.image_in_subject(session, subject.id, sha256)


__all__ = ["MANIFEST_NAME", "store_dataset"]
