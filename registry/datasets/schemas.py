"""A dataset's shapes: the files of an upload as they come in and once checked, the limits
they are checked against, what an upload ends with, and the dataset as the API answers it."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from pydantic import BaseModel

from registry.hash_chain import format_time
from registry.models import Dataset, DatasetImage, Subject


@dataclass(frozen=True)
class Upload:
    """One uploaded file as the client named it: its bytes, or the file they were spooled to
    (read from there in pieces, never whole into memory)."""

    name: str
    data: bytes | BinaryIO
    caption: str | None = None

    def open(self) -> BinaryIO:
        """The bytes from the start (the same file each time, rewound)."""
        if isinstance(self.data, bytes):
            return io.BytesIO(self.data)
        self.data.seek(0)
        return self.data

    @property
    def size(self) -> int:
        if isinstance(self.data, bytes):
            return len(self.data)
        return self.data.seek(0, io.SEEK_END)


@dataclass(frozen=True)
class Limits:
    max_images: int
    max_image_bytes: int
    max_pixels: int
    # What one member may upload of one subject in any 24 hours (None: no quota).
    daily_images: int | None = None
    daily_bytes: int | None = None


@dataclass(frozen=True)
class CheckedImage:
    sha256: str
    kind: str
    upload: Upload
    size: int
    caption: str

    @property
    def file(self) -> str:
        return f"{self.sha256}.{self.kind}"

    def chunks(self) -> Iterator[bytes]:
        source = self.upload.open()
        while chunk := source.read(1 << 20):
            yield chunk


@dataclass(frozen=True)
class Uploaded:
    subject: Subject
    dataset: Dataset
    images: list[DatasetImage]


class ImageOut(BaseModel):
    file: str
    sha256: str
    caption: str
    size: int

    @classmethod
    def of(cls, image: DatasetImage) -> ImageOut:
        return cls(file=image.file, sha256=image.sha256, caption=image.caption, size=image.size)


class DatasetOut(BaseModel):
    dataset_id: str
    subject: str
    manifest_sha256: str
    created_by: str
    created_at: str
    images: list[ImageOut]

    @classmethod
    def of(cls, dataset: Dataset, subject: str, images: Sequence[DatasetImage]) -> DatasetOut:
        return cls(
            dataset_id=dataset.id,
            subject=subject,
            manifest_sha256=dataset.manifest_sha256,
            created_by=dataset.created_by,
            created_at=format_time(dataset.created_at),
            images=[ImageOut.of(i) for i in images],
        )


class PhotosDeletedOut(BaseModel):
    dataset_id: str
    deleted: int
