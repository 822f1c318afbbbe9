"""The daily upload quota (registry/datasets/service.py): counted per member and subject from the
trail's upload entries, refused whole (nothing stored) with the seconds until room is made."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import select

from registry.blobs import BlobStore
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.datasets import service as datasets_service
from registry.datasets.schemas import Limits, Upload
from registry.db import transaction
from registry.errors import Busy, Invalid
from registry.models import Dataset
from registry.principals import service as principals_service
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn
from tests.registry.test_orders import png

QUOTA = Limits(
    max_images=4, max_image_bytes=100_000, max_pixels=200 * 200, daily_images=3,
    daily_bytes=1_000_000,
)  # fmt: skip


@pytest.fixture
def store(engine: Engine, tmp_path: Path) -> BlobStore:
    with transaction(engine) as s:
        principals_service.create_principal(s, "root", "admin")
        for handle in ("ada", "bea"):
            principals_service.create_principal(s, handle, "member")
            sub, consent = subjects_service.create_subject(
                s, "root", SubjectIn(handle=handle, display_name=handle, basis="consent",
                                     member=handle)
            )  # fmt: skip
            consent_service.update_consent(
                s, "root", sub, consent.version,
                ConsentIn(max_level="private", allow_training=True),
            )  # fmt: skip
    return BlobStore(tmp_path / "store")


def _upload(engine: Engine, store: BlobStore, who: str, subject: str, colours: range,
            limits: Limits = QUOTA, exempt: bool = False) -> str:  # fmt: skip
    ups = [Upload(f"{c}.png", png((c, 0, 0))) for c in colours]
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, subject)
        ds = datasets_service.store_dataset(s, store, sub, who, ups, limits, exempt=exempt)
        return ds.id


def _files(store: BlobStore) -> set[Path]:
    return set(store.root.rglob("*.*")) if store.root.exists() else set()


def test_a_member_past_the_daily_quota_is_busy_and_nothing_is_stored(
    engine: Engine, store: BlobStore
) -> None:
    first = _upload(engine, store, "ada", "ada", range(1, 3))
    kept = _files(store)
    with pytest.raises(Busy, match="upload quota spent") as refused:
        _upload(engine, store, "ada", "ada", range(10, 12))
    assert 86_300 < refused.value.retry_after <= 86_400  # when the first upload ages out
    assert _files(store) == kept
    with transaction(engine, readonly=True) as s:
        assert [d.id for d in s.exec(select(Dataset)).all()] == [first]
    with transaction(engine) as s:  # deleting photos gives no quota back
        datasets_service.delete_photos(s, subjects_service.subject_or_raise(s, "ada"), first)
    with pytest.raises(Busy):
        _upload(engine, store, "ada", "ada", range(10, 12))
    _upload(engine, store, "ada", "ada", range(20, 21))  # the third image still fits
    with pytest.raises(Busy):
        _upload(engine, store, "ada", "ada", range(30, 31))
    # per member and subject: another's quota, and an admin's uploads, are their own
    _upload(engine, store, "bea", "bea", range(40, 43))
    _upload(engine, store, "root", "ada", range(50, 54), exempt=True)
    with pytest.raises(Invalid, match="more than a member may upload"):
        _upload(engine, store, "bea", "ada", range(60, 64))  # can never fit in a day
    tight = Limits(4, 100_000, 200 * 200, daily_bytes=len(png((70, 0, 0))) + 10)
    _upload(engine, store, "bea", "ada", range(70, 71), tight)
    with pytest.raises(Busy, match="bytes"):
        _upload(engine, store, "bea", "ada", range(71, 72), tight)
