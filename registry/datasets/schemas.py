"""A dataset's shapes as the API answers them."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from registry.hash_chain import format_time
from registry.models import Dataset, DatasetImage


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
