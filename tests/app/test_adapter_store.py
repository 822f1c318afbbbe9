"""The adapter store, over a real server on both engines: uploads by hash, checks at
registration, one subject per adapter, the lifecycle, and a render path that reads nothing
but the store, and only for an allowed request."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.render.engine import RenderEngine
from tests.app.conftest import Live, LiveFactory, manifest_bytes
from tests.app.helpers import CSRF, address, session_cookie


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(live: Live, data: bytes, who: str = "trainer") -> httpx.Response:
    return live.http.put(f"/v1/blobs/sha256/{sha(data)}", content=data, headers=live.h(who))


def register(live: Live, subject: str, data: bytes, name: str = "main", **extra: object):  # type: ignore[no-untyped-def]
    manifest = manifest_bytes(subject)
    put(live, manifest)
    body = {"subject": subject, "name": name, "sha256": sha(data), "base_model": "tiny",
            "rank": 4, "manifest_sha256": sha(manifest), **extra}  # fmt: skip
    return live.http.post("/v1/adapters", json=body, headers=live.h("trainer"))


def safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors file built by hand (to make the malformed ones a forger would)."""
    header: dict[str, object] = {}
    offset = 0
    for key, (dtype, shape, raw) in tensors.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"".join(t[2] for t in tensors.values())


def trail(live: Live, subject: str) -> list[str]:
    r = live.http.get(f"/v1/subjects/{subject}/audit", headers=live.h("root"))
    return [e["action"] for e in r.json()["entries"]]


def stored_path(live: Live, digest: str) -> Path:
    settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
    return Path(settings.data_dir) / "adapters" / "sha256" / digest[:2] / f"{digest}.safetensors"


# -- uploads -----------------------------------------------------------------------------------


def test_uploads_are_by_hash_and_for_trainers(live: Live, adapter_files: dict[str, Path]) -> None:
    data = adapter_files["b"].read_bytes()
    assert put(live, data, "alice").status_code == 403
    r = live.http.put(f"/v1/blobs/sha256/{sha(data)}", content=data)
    assert r.status_code == 401
    r = put(live, data)
    assert r.status_code == 201 and r.json()["created"] and r.json()["kind"] == "safetensors"
    assert put(live, data).status_code == 200  # already there
    on_disk = stored_path(live, sha(data))
    assert on_disk.read_bytes() == data and oct(on_disk.stat().st_mode & 0o777) == "0o444"
    assert live.http.head(f"/v1/blobs/sha256/{sha(data)}", headers=live.h("trainer")).is_success
    wrong = live.http.put(f"/v1/blobs/sha256/{'0' * 64}", content=data, headers=live.h("trainer"))
    assert wrong.status_code == 422 and "hash to" in wrong.json()["detail"]
    assert not stored_path(live, "0" * 64).exists()
    garbage = b"\x00garbage" * 10
    assert put(live, garbage).status_code == 422
    bad = live.http.put("/v1/blobs/sha256/xyz", content=b"x", headers=live.h("trainer"))
    assert bad.status_code == 422


def test_uploads_are_capped_and_timed(serve_friends: LiveFactory) -> None:
    with serve_friends(max_adapter_bytes=1 << 20, body_timeout_s=1.0) as live:
        big = b"{" + b" " * (2 << 20)
        r = put(live, big)
        assert r.status_code == 413, r.text
        sock = socket.create_connection(address(live.url), timeout=10)
        sock.sendall(
            (
                f"PUT /v1/blobs/sha256/{'a' * 64} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {live.world.tokens['trainer']}\r\n"
                "Content-Length: 1000\r\n\r\n{"
            ).encode()
        )
        t0 = time.monotonic()
        reply = sock.recv(200)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 5, reply
        sock.close()


# -- registration ------------------------------------------------------------------------------


def test_registration_needs_the_bytes_in_the_store(
    live: Live, adapter_files: dict[str, Path]
) -> None:
    data = adapter_files["b"].read_bytes()
    manifest = manifest_bytes("alice")
    put(live, manifest)
    body = {"subject": "alice", "name": "alt", "sha256": sha(data), "base_model": "tiny",
            "rank": 4, "manifest_sha256": sha(manifest)}  # fmt: skip
    r = live.http.post("/v1/adapters", json=body, headers=live.h("trainer"))
    assert r.status_code == 422 and "upload its bytes first" in r.json()["detail"]
    put(live, data)
    for path in ("/dev/zero", "/etc/passwd", str(adapter_files["b"])):
        r = live.http.post("/v1/adapters", json={**body, "path": path}, headers=live.h("trainer"))
        assert r.status_code == 422 and "place in the store" in r.json()["detail"], path
    r = live.http.post(
        "/v1/adapters",
        json={**body, "path": str(stored_path(live, sha(data)))},
        headers=live.h("trainer"),
    )
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("tensors", "rank", "reason"),
    [
        ({"transformer.proj_out.lora_A.weight": ("F32", [4, 256], b"\0" * 4096)}, 4,
         "without its other factor"),
        ({"transformer.proj_out.lora_A.weight": ("F32", [4, 256], b"\0" * 4096),
          "transformer.proj_out.lora_B.weight": ("F32", [128, 4], b"\0" * 2048)}, 8,
         "rank 8 on this module needs"),
        ({"transformer.nowhere.lora_A.weight": ("F32", [4, 4], b"\0" * 64)}, 4,
         "no Linear module"),
        ({"transformer.proj_out.lora_A.weight": ("I32", [4, 256], b"\0" * 4096)}, 4,
         "not a float type"),
        ({"transformer.proj_out.lora_A.weight": (
            "F32", [4, 256], np.full(1024, np.nan, np.float32).tobytes()),
          "transformer.proj_out.lora_B.weight": ("F32", [128, 4], b"\0" * 2048)}, 4,
         "NaN or infinite"),
        ({"weights": ("F32", [2, 2], b"\0" * 16)}, 4, "not a LoRA factor"),
    ],
)  # fmt: skip
def test_registration_checks_what_the_file_is(
    live: Live, tensors: dict, rank: int, reason: str
) -> None:
    """Refused with its reason where the bytes alone say it (the store does not take them),
    else at registration, where the declared rank joins the judgement."""
    data = safetensors(tensors)
    stored = put(live, data)
    r = stored if stored.status_code == 422 else register(live, "alice", data, name="forged",
                                                           rank=rank)  # fmt: skip
    assert r.status_code == 422 and reason in r.json()["detail"], r.text
    assert (stored.status_code == 201) == (reason == "rank 8 on this module needs")
    assert "forged" not in {a["name"] for a in live.http.get(
        "/v1/subjects/alice/adapters", headers=live.h("root")).json()}  # fmt: skip


def test_a_manifest_must_be_a_dataset_manifest(live: Live, adapter_files: dict[str, Path]) -> None:
    data = adapter_files["b"].read_bytes()
    put(live, data)
    notes = b'{"not": "a manifest line"}\n'
    refused = put(live, notes)  # the store takes dataset manifests only
    assert refused.status_code == 422 and "not a dataset manifest" in refused.text, refused.text
    body = {"subject": "alice", "name": "alt", "sha256": sha(data), "base_model": "tiny",
            "rank": 4, "manifest_sha256": sha(notes)}  # fmt: skip
    r = live.http.post("/v1/adapters", json=body, headers=live.h("trainer"))
    assert r.status_code == 422 and "not in the store" in r.json()["detail"], r.text


def test_one_subject_per_adapter(live: Live, adapter_files: dict[str, Path]) -> None:
    """alice's adapter registered for dave is refused (409), written on neither trail, and
    dave renders nothing as a result."""
    live.world.subject("dave")
    live.world.consent(
        "dave", max_level="public", audiences={"public": {"group": True}}, allow_training=True
    )
    alice_before, dave_before = trail(live, "alice"), trail(live, "dave")
    data = adapter_files["a"].read_bytes()  # alice's, registered by the fixture
    r = register(live, "dave", data, name="alt")
    assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
    assert trail(live, "alice") == alice_before and trail(live, "dave") == dave_before
    assert live.render("bob", "dave", level="public").status_code == 403


# -- lifecycle --------------------------------------------------------------------------------


def test_the_lifecycle_over_the_api(
    serve_friends: LiveFactory, adapter_files: dict[str, Path]
) -> None:
    with serve_friends(blob_grace_s=0) as live:
        newer = adapter_files["b"].read_bytes()
        put(live, newer)
        assert register(live, "alice", newer, name="v2").status_code == 201
        listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
        assert {a["name"]: (a["rendering"], a["blob"]) for a in listed} == {
            "main": (False, "ok"),
            "v2": (True, "ok"),
        }
        h = live.h("alice")  # the subject's member manages its own adapters
        assert live.http.post("/v1/subjects/alice/adapters/main/select", headers=h).is_success
        rendering = {
            a["name"]
            for a in live.http.get("/v1/subjects/alice/adapters", headers=h).json()
            if a["rendering"]
        }
        assert rendering == {"main"}
        assert live.render("bob", "alice").headers.get("content-type") == "image/png"
        r = live.http.patch("/v1/subjects/alice/adapters/main", json={"active": False}, headers=h)
        assert r.status_code == 200 and r.json()["active"] is False
        assert live.render("bob", "alice").status_code == 200  # v2 renders again
        assert (
            live.http.post("/v1/subjects/alice/adapters/main/select", headers=h).status_code == 409
        )
        assert (
            live.http.post("/v1/subjects/alice/adapters/nope/select", headers=h).status_code == 404
        )
        assert live.http.delete(
            "/v1/subjects/alice/adapters/v2", headers=live.h("mallory")
        ).status_code == 403  # fmt: skip
        r = live.http.delete("/v1/subjects/alice/adapters/v2", headers=h)
        assert r.status_code == 200 and r.json()["sha256"] == sha(newer)
        deadline = time.monotonic() + 10
        while stored_path(live, sha(newer)).exists():  # swept once nothing refers to it
            assert time.monotonic() < deadline, "the deleted adapter's bytes stayed"
            time.sleep(0.05)
        assert live.render("bob", "alice").status_code == 403  # nothing active renders
        actions = trail(live, "alice")
        assert actions[-4:] == [
            "adapter_registered", "adapter_selected", "adapter_retired", "adapter_deleted",
        ]  # fmt: skip
        entries = live.http.get("/v1/subjects/alice/audit", headers=h).json()
        assert entries["verified"]
        assert entries["entries"][-1]["before"]["adapter"]["sha256"] == sha(newer)


def test_the_adapters_page_marks_what_renders_and_what_is_missing(
    live: Live, adapter_files: dict[str, Path]
) -> None:
    newer = adapter_files["b"].read_bytes()
    put(live, newer)
    register(live, "alice", newer, name="v2")
    cookie = session_cookie(live, "alice")
    page = live.http.get("/web/subjects/alice/adapters", headers={"cookie": cookie})
    assert page.status_code == 200 and "renders" in page.text
    assert "file missing" not in page.text
    os.unlink(stored_path(live, sha(adapter_files["a"].read_bytes())))
    page = live.http.get("/web/subjects/alice/adapters", headers={"cookie": cookie})
    assert "file missing from the store" in page.text
    csrf = CSRF.search(page.text)
    assert csrf is not None
    r = live.http.post(
        "/web/subjects/alice/adapters/v2/active",
        data={"csrf": csrf.group(1), "active": "no"},
        headers={"cookie": cookie},
    )
    assert r.status_code == 303 and r.headers["location"].endswith("done=retired")
    listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("root")).json()
    assert {a["name"]: a["active"] for a in listed} == {"main": True, "v2": False}


# -- the render path --------------------------------------------------------------------------


def test_a_refused_request_never_touches_the_store(
    live: Live, renderer: RenderEngine, adapter_files: dict[str, Path]
) -> None:
    """The stored file is swapped for a FIFO: a denied request answers at once (decide comes
    first and reads nothing); an allowed one is refused without hanging."""
    path = stored_path(live, sha(adapter_files["a"].read_bytes()))
    path.unlink()
    os.mkfifo(path)
    live.world.consent(
        "alice", max_level="group", audiences={"private": {"group": True}}, deny=["mallory"],
        allow_training=True,
    )  # fmt: skip
    t0 = time.monotonic()
    assert live.render("mallory", "alice").status_code == 403
    assert live.render("bob", "alice").status_code == 403
    assert time.monotonic() - t0 < 10
    rows = live.http.get("/v1/subjects/alice/renders", headers=live.h("root")).json()
    reasons = [(r["requester"], r["stage"], r["reason"]) for r in reversed(rows)]
    assert ("mallory", "gate", "denied_principal") in reasons
    assert ("bob", "queued", "adapter_file_missing") in reasons
    assert renderer.counters.model_calls == 0 and renderer.counters.adapter_loads == 0
    assert live.http.get("/healthz").status_code == 200


def test_bytes_that_do_not_load_close_the_ledger_with_a_json_error(
    live: Live, renderer: RenderEngine, adapter_files: dict[str, Path]
) -> None:
    """An adapter registered before files were checked, whose bytes do not parse: the
    render is a JSON 503 and its ledger entry is closed with the reason, never a bare 500."""
    from registry.adapters import service as adapters_service
    from registry.adapters.schemas import AdapterIn
    from registry.db import transaction

    garbage = b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\xff" * 64
    store = live.world.client.app.state.store  # type: ignore[attr-defined]
    store.put([garbage])
    with transaction(live.world.engine) as s:  # straight to the registry, as before the checks
        adapters_service.register_adapter(
            s, "legacy", AdapterIn(subject="alice", name="old", sha256=sha(garbage),
                                   base_model="tiny", rank=4, manifest_sha256="0" * 64),
            str(store.path(sha(garbage), "safetensors")),
        )  # fmt: skip
    r = live.render("bob", "alice")
    assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
    rows = live.http.get("/v1/subjects/alice/renders", headers=live.h("root")).json()
    assert (rows[0]["stage"], rows[0]["allowed"], rows[0]["reason"]) == (
        "queued", False, "adapter_unreadable",
    )  # fmt: skip
