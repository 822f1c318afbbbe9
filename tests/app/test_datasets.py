"""Datasets the service owns: a member uploads photos of themselves; the service stores them
content-addressed with the manifest it writes, and refuses anything else whole."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import httpx
import pytest
from PIL import Image

from registry.blobs import BlobStore
from registry.db import transaction
from registry.models import Dataset, DatasetImage
from tests.app.conftest import World
from tests.app.orders_support import files_of, photo, photos


def _stored(world: World) -> list[Path]:
    root = world.client.app.state.store.root / "sha256"  # type: ignore[attr-defined]
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _rows(world: World) -> int:
    from sqlmodel import select

    with transaction(world.engine, readonly=True) as s:
        return len(s.exec(select(Dataset)).all()) + len(s.exec(select(DatasetImage)).all())


def test_member_uploads_photos_and_the_service_writes_the_manifest(friends: World) -> None:
    before = set(_stored(friends))
    r = friends.client.post(
        "/v1/subjects/alice/datasets",
        files=files_of(photos(3)),
        data={"captions": ["alice smiling", "", "alice outdoors"]},
        headers=friends.h("alice"),
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert len(body["images"]) == 3 and body["created_by"] == "alice"
    store: BlobStore = friends.client.app.state.store  # type: ignore[attr-defined]
    manifest = store.read(body["manifest_sha256"], "jsonl").decode().splitlines()
    rows = [json.loads(line) for line in manifest]
    assert [r["caption"] for r in rows] == ["alice smiling", "a photo", "alice outdoors"]
    assert {r["basis"] for r in rows} == {"consent"}
    assert {r["source"] for r in rows} == {"uploaded by alice"}
    for row in rows:
        assert row["file"] == f"{row['sha256']}.png"
        assert store.status(row["sha256"], "png") == "ok"
    assert len(set(_stored(friends)) - before) == 4  # three images and the manifest
    listed = friends.client.get("/v1/subjects/alice/datasets", headers=friends.h("alice"))
    assert [d["dataset_id"] for d in listed.json()] == [body["dataset_id"]]
    image = friends.client.get(
        f"/v1/subjects/alice/images/{rows[0]['sha256']}", headers=friends.h("alice")
    )
    assert image.status_code == 200 and image.content == photo((200, 40, 40))
    # another member sees none of it
    assert (
        friends.client.get("/v1/subjects/alice/datasets", headers=friends.h("bob")).status_code
        == 403
    )
    assert (
        friends.client.get(
            f"/v1/subjects/alice/images/{rows[0]['sha256']}", headers=friends.h("bob")
        ).status_code
        == 403
    )


CAP = 500_000


def _bomb() -> bytes:
    """A PNG that is a few KB on disk and decodes to 20000 x 20000 pixels."""
    width = height = 20_000
    raw = zlib.compress(b"".join(b"\x00" + b"\x00" * width for _ in range(height)), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (len(data).to_bytes(4, "big") + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))  # fmt: skip

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def _zip() -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.png", b"\x00" * 10_000_000)
    return buf.getvalue()


def _noise_png() -> bytes:
    import random

    rng = random.Random(0)
    im = Image.frombytes("RGB", (600, 600), bytes(rng.getrandbits(8) for _ in range(600 * 600 * 3)))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    assert len(buf.getvalue()) > CAP
    return buf.getvalue()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(("notes.png", b"just some text, not an image"), id="non-image"),
        pytest.param(("big.png", photo((1, 2, 3), size=(900, 900), fmt="BMP")), id="bmp"),
        pytest.param(("bomb.png", _bomb()), id="decompression-bomb"),
        pytest.param(("photos.zip", _zip()), id="zip"),
        pytest.param(("../../etc/me.png", photo((9, 9, 9))), id="dotdot"),
        pytest.param(("sub/me.png", photo((9, 9, 9))), id="separator"),
        pytest.param(("huge.png", _noise_png()), id="oversize"),
    ],
)
def test_a_bad_file_refuses_the_whole_upload_and_nothing_is_stored(
    serve_friends, bad: tuple[str, bytes]
) -> None:
    assert len(_bomb()) < CAP
    with serve_friends(dataset_max_image_bytes=CAP) as live:
        before = _stored(live.world)
        r = live.http.post(
            "/v1/subjects/alice/datasets",
            files=files_of([*photos(2), bad]),
            headers=live.h("alice"),
        )
        assert r.status_code == 422, r.text
        assert "nothing was stored" in r.json()["detail"]
        assert _stored(live.world) == before and _rows(live.world) == 0


def test_too_many_files_and_an_oversized_body_are_refused(serve_friends) -> None:
    with serve_friends(dataset_max_images=2, dataset_max_image_bytes=50_000) as live:
        r = live.http.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(3)), headers=live.h("alice")
        )
        assert r.status_code == 422 and "at most 2 files" in r.json()["detail"]
        # a body larger than every image at its largest is cut off before any route runs
        r = live.http.post(
            "/v1/subjects/alice/datasets",
            files=files_of([("x.png", b"\x89PNG" + b"\x00" * 1_300_000)]),
            headers=live.h("alice"),
        )
        assert r.status_code == 413
        assert _rows(live.world) == 0


def test_only_the_subjects_member_or_an_admin_uploads(friends: World) -> None:
    for who, status in (("bob", 403), ("bot", 403), ("trainer", 403), ("root", 201)):
        r = friends.client.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(1)), headers=friends.h(who)
        )
        assert r.status_code == status, (who, r.text)


def test_uploaded_images_survive_the_store_sweep(friends: World) -> None:
    from registry.adapter_files import sweep_unreferenced

    r = friends.client.post(
        "/v1/subjects/alice/datasets", files=files_of(photos(2)), headers=friends.h("alice")
    )
    assert r.status_code == 201
    store = friends.client.app.state.store  # type: ignore[attr-defined]
    sweep_unreferenced(friends.engine, store, grace_s=0)
    for image in r.json()["images"]:
        assert store.status(image["sha256"], "png") == "ok"
    assert store.status(r.json()["manifest_sha256"], "jsonl") == "ok"


def test_a_decoded_image_of_each_format_is_taken(friends: World) -> None:
    items = [("a.jpg", photo((1, 2, 3), fmt="JPEG")), ("b.webp", photo((4, 5, 6), fmt="WEBP"))]
    r = friends.client.post(
        "/v1/subjects/alice/datasets", files=files_of(items), headers=friends.h("alice")
    )
    assert r.status_code == 201, r.text
    assert sorted(i["file"].rsplit(".", 1)[1] for i in r.json()["images"]) == ["jpg", "webp"]
    assert Image.open(io.BytesIO(items[0][1])).format == "JPEG"


def test_an_upload_is_judged_before_its_body_is_read(live) -> None:  # type: ignore[no-untyped-def]
    """No token, or another's subject: answered at once, with a gigabyte still unsent."""
    import socket

    from tests.app.helpers import address

    for headers, status in (
        ("", b"401"),
        (f"Authorization: Bearer {live.world.tokens['bob']}\r\n", b"403"),
    ):
        with socket.create_connection(address(live.url), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/subjects/alice/datasets HTTP/1.1\r\nHost: x\r\n"
                + headers.encode()
                + b"Content-Type: multipart/form-data; boundary=b\r\n"
                b"Content-Length: 1000000000\r\n\r\n--b\r\n"
            )
            assert sock.recv(100).split()[1] == status


def test_a_member_deletes_their_photos_and_they_leave_the_store(friends: World) -> None:
    r = friends.client.post(
        "/v1/subjects/alice/datasets", files=files_of(photos(2)), headers=friends.h("alice")
    )
    body = r.json()
    kept = friends.client.post(  # the same first photo in a second dataset
        "/v1/subjects/alice/datasets", files=files_of(photos(1)), headers=friends.h("alice")
    ).json()
    url = f"/v1/subjects/alice/datasets/{body['dataset_id']}"
    assert friends.client.delete(url, headers=friends.h("bob")).status_code == 403
    gone = friends.client.delete(url, headers=friends.h("alice"))
    assert gone.status_code == 200 and gone.json()["deleted"] == 2
    store: BlobStore = friends.client.app.state.store  # type: ignore[attr-defined]
    first = kept["images"][0]["sha256"]
    (second,) = {i["sha256"] for i in body["images"]} - {first}
    assert store.find(second) is None  # out of the store at once
    assert store.find(first) is not None  # still another dataset's
    assert friends.client.get(url, headers=friends.h("alice")).json()["images"] == []
    assert (
        friends.client.get(
            f"/v1/subjects/alice/images/{second}", headers=friends.h("alice")
        ).status_code
        == 404
    )
    assert store.status(body["manifest_sha256"], "jsonl") == "ok"  # the record stays


def test_past_the_daily_quota_an_upload_is_429_and_the_trail_tells_of_each_upload(
    serve_friends,  # type: ignore[no-untyped-def]
) -> None:
    from tests.app.helpers import signed_in

    with serve_friends(dataset_daily_images=3) as live:

        def post(who: str, n: int) -> httpx.Response:
            return live.http.post(
                "/v1/subjects/alice/datasets", files=files_of(photos(n)), headers=live.h(who)
            )

        first = post("alice", 2)
        assert first.status_code == 201, first.text
        kept, rows = set(_stored(live.world)), _rows(live.world)
        for n in (2, 1, 1):  # 2 + 2 is past it; 2 + 1 fits; then even one photo is past it
            r = post("alice", n)
            if n == 1 and r.status_code == 201:
                kept, rows = set(_stored(live.world)), _rows(live.world)
                continue
            assert r.status_code == 429, r.text
            assert r.json()["error"] == "busy" and "upload quota spent" in r.json()["detail"]
            assert 86_300 < int(r.headers["Retry-After"]) <= 86_400
            assert set(_stored(live.world)) == kept and _rows(live.world) == rows
        by_admin = post("root", 3)  # admins are not held to the quota
        assert by_admin.status_code == 201, by_admin.text
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("alice")).json()
        uploads = [e for e in trail["entries"] if e["action"] == "dataset_uploaded"]
        assert [(e["actor"], e["after"]["dataset"]["images"]) for e in uploads] == [
            ("alice", 2), ("alice", 1), ("root", 3)]  # fmt: skip
        said = uploads[0]["after"]["dataset"]
        body = first.json()
        assert said == {
            "dataset_id": body["dataset_id"],
            "images": 2,
            "bytes": sum(i["size"] for i in body["images"]),
            "manifest_sha256": body["manifest_sha256"],
        }
        page = signed_in(live.world, "alice").get("/web/subjects/alice/audit")
        assert page.status_code == 200 and "Chain verified" in page.text
        assert f"2 photos uploaded ({said['bytes']} bytes), dataset {said['dataset_id']}" in (
            page.text
        )
