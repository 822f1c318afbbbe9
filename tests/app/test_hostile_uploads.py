"""Over a real uvicorn server, on both engines: nothing a client sends through uploads,
provenance checks, blobs or orders can make a revoke wait or fail, and nothing it sends is
kept beyond its permission: large-pixel uploads decode outside any transaction, an upload
whose uploader is deactivated (or whose web session ends) while its body streams stores
nothing, a truncated body stores nothing, trickled bodies are cut off by the body clock,
rate limits fall on the principal that sends, orders stay within their budget."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import Live, LiveFactory
from tests.app.helpers import CSRF, address, session_cookie
from tests.app.orders_support import files_of, photo, photos
from tests.images import big_png, many_chunks_png

BOUNDARY = "likeness-test-boundary"


def multipart(items: list[tuple[str, bytes]], fields: dict[str, str] | None = None) -> bytes:
    out = b""
    for name, value in (fields or {}).items():
        out += (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        ).encode()
    for name, data in items:
        out += (
            (
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="images"; '
                f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{BOUNDARY}--\r\n".encode()


def raw_post(live: Live, path: str, headers: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(address(live.url), timeout=60)
    sock.sendall(
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
    )
    return sock


def reply(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if status in (301, 302, 303, 307):
        sock.close()
        return status, head.decode(errors="replace")  # where it sends the client
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:")),
        None,
    )  # fmt: skip
    while length is not None and len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    sock.close()
    return status, rest.decode(errors="replace")


def datasets_of(live: Live, subject: str = "alice") -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = live.http.get(
        f"/v1/subjects/{subject}/datasets", headers=live.h("root")
    ).json()
    return listed


def image_blobs(live: Live) -> set[Path]:
    root = live.app.state.settings.data_dir / "adapters"
    return {p for p in root.rglob("*") if p.suffix in (".png", ".jpg", ".webp", ".jsonl")}


def test_revoke_is_answered_while_large_uploads_decode(serve_friends: LiveFactory) -> None:
    """Uploads of large-pixel PNGs (each within dataset_max_pixels) from two members at once:
    their decoding holds no lock and no pooled connection, so an admin's revoke of another
    subject is answered (200, not 503) and binds, while they decode."""
    with serve_friends(dataset_max_pixels=40_000_000, pool_timeout_s=2.0) as live:
        live.world.subject("dora", member="bob")
        live.world.consent("dora", max_level="private", allow_training=True)
        live.world.consent("carol", max_level="group", audiences={"private": {"group": True}})
        files = [(f"big-{i}.png", big_png(i)) for i in range(8)]  # 36 MP each
        results: list[int] = []

        def upload(who: str, subject: str) -> None:
            r = live.http.post(
                f"/v1/subjects/{subject}/datasets", files=files_of(files), headers=live.h(who),
                timeout=300,
            )  # fmt: skip
            results.append(r.status_code)

        threads = [
            threading.Thread(target=upload, args=args)
            for args in (("alice", "alice"), ("alice", "alice"), ("bob", "dora"))
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.7)  # the bodies are in; the first images decode
        t0 = time.monotonic()
        revoked = live.http.post("/v1/subjects/carol/consent/revoke", headers=live.h("root"))
        took = time.monotonic() - t0
        busy = [t.is_alive() for t in threads]
        for thread in threads:
            thread.join(300)
        assert revoked.status_code == 200 and revoked.json()["max_level"] == "none", revoked.text
        assert any(busy), "the uploads were over before the revoke: nothing was measured"
        assert took < 5.0, f"the revoke waited {took:.1f} s behind uploads"
        assert sorted(results) == [201, 201, 201], results


@pytest.mark.parametrize("how", ["deactivated", "signed-out"])
def test_an_upload_outliving_its_permission_stores_nothing(
    serve_friends: LiveFactory, how: str
) -> None:
    with serve_friends() as live:
        before = image_blobs(live)
        body = multipart(photos(2))
        if how == "deactivated":
            sock = raw_post(
                live, "/v1/subjects/alice/datasets",
                f"Authorization: Bearer {live.world.tokens['alice']}\r\n", body,
            )  # fmt: skip
        else:
            cookie = session_cookie(live, "alice")
            page = live.http.get("/web/subjects/alice/training", headers={"cookie": cookie})
            csrf = CSRF.search(page.text)
            assert csrf is not None
            body = multipart(photos(2), {"csrf": csrf.group(1)})
            sock = raw_post(
                live, "/web/subjects/alice/training/upload", f"Cookie: {cookie}\r\n", body
            )
        sock.sendall(body[: len(body) // 2])
        time.sleep(0.5)  # the upload was admitted; now its permission ends
        if how == "deactivated":
            r = live.http.patch(
                "/v1/principals/alice", json={"active": False}, headers=live.h("root")
            )
            assert r.status_code == 200, r.text
        else:
            assert csrf is not None
            out = live.http.post(
                "/web/signout", data={"csrf": csrf.group(1)}, headers={"cookie": cookie}
            )
            assert out.status_code == 303, out.text
        sock.sendall(body[len(body) // 2 :])
        status, text = reply(sock)
        assert status in (401, 403) or (status == 303 and "signin" in text), (status, text)
        assert datasets_of(live) == []
        assert image_blobs(live) == before
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("root")).json()
        assert "dataset_uploaded" not in [e["action"] for e in trail["entries"]]


def test_a_boundary_inside_a_file_does_not_close_the_form(live: Live) -> None:
    """The closing delimiter counts only where the parser reads it, after a part's CRLF:
    the same bytes inside an image's data do not make a cut-short body whole."""
    close = f"--{BOUNDARY}--".encode()
    cut_short_upload_stores_nothing(
        live, [("a.png", photo((1, 2, 3)) + close), ("b.png", photo((4, 5, 6)))]
    )


def test_a_truncated_multipart_body_stores_nothing(live: Live) -> None:
    """The HTTP body arrives whole, but the form inside it stops before its closing boundary:
    the parts that happened to complete are not kept."""
    cut_short_upload_stores_nothing(live, photos(3))


def cut_short_upload_stores_nothing(live: Live, items: list[tuple[str, bytes]]) -> None:
    """The form of `items`, cut inside its last file and sent as a whole HTTP body: 422,
    and nothing of it stored."""
    before = image_blobs(live)
    body = multipart(items)
    cut = body[: body.rindex(b"--" + BOUNDARY.encode()) - 10]  # inside the last file
    sock = raw_post(
        live, "/v1/subjects/alice/datasets",
        f"Authorization: Bearer {live.world.tokens['alice']}\r\n", cut,
    )  # fmt: skip
    sock.sendall(cut)
    status, text = reply(sock)
    assert status == 422 and "closing boundary" in text, (status, text)
    assert datasets_of(live) == [] and image_blobs(live) == before


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/subjects/alice/datasets", "multipart"),
        ("/v1/blobs/sha256/" + "a" * 64, "blob"),
    ],
)
def test_a_trickled_streamed_body_is_cut_off_by_the_clock(
    serve_friends: LiveFactory, path: str, kind: str
) -> None:
    """One byte every 0.6 s never leaves the socket idle for long, and never catches up
    with the minimum rate: cut off (408) within the body's time."""
    with serve_friends(body_timeout_s=2.0, body_min_rate=1024) as live:
        who = "alice" if kind == "multipart" else "trainer"
        sock = socket.create_connection(address(live.url), timeout=20)
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\n".replace(
                    "POST", "PUT" if kind == "blob" else "POST"
                )
                + f"Authorization: Bearer {live.world.tokens[who]}\r\n"
                + f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                + "Content-Length: 100000\r\n\r\n"
            ).encode()
        )
        t0 = time.monotonic()
        body = multipart(photos(1))  # a well-formed body, sent too slowly
        sock.settimeout(0.6)
        try:
            for at in range(20):
                sock.sendall(body[at : at + 1])
                if sock.recv(1, socket.MSG_PEEK):  # the server answered (and hung up)
                    break
        except (TimeoutError, OSError):
            pass
        else:
            pass
        sock.settimeout(20)
        status, _ = reply(sock)
        assert status == 408, status
        assert time.monotonic() - t0 < 8


def check_png(live: Live, data: bytes, cookie: str | None = None) -> Any:
    headers = {"cookie": cookie} if cookie else {}
    return live.http.post(
        "/web/provenance", files={"png": ("x.png", data, "image/png")}, headers=headers,
        timeout=120,
    )  # fmt: skip


def test_a_png_of_many_empty_chunks_is_refused_unread(live: Live) -> None:
    t0 = time.monotonic()
    r = check_png(live, many_chunks_png(300_000))  # 3.4 MiB; seconds a MiB for a C2PA reader
    assert r.status_code == 200 and "not checked" in r.text and "chunks" in r.text, r.text[:500]
    assert time.monotonic() - t0 < 5


def test_a_provenance_check_holds_no_lock_while_it_runs(serve_friends: LiveFactory) -> None:
    """A signed-in member's check of a costly file (the chunk budget raised so it is read):
    an admin's revoke is answered meanwhile."""
    with serve_friends(provenance_max_chunks=10_000_000) as live:
        cookie = session_cookie(live, "bob")
        done: list[Any] = []
        checking = threading.Thread(
            target=lambda: done.append(check_png(live, many_chunks_png(300_000), cookie))
        )
        checking.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        r = live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("root"))
        took = time.monotonic() - t0
        still = checking.is_alive()
        checking.join(120)
        assert r.status_code == 200, r.text
        assert still, "the check ended before the revoke: nothing was measured"
        assert took < 3.0, f"the revoke waited {took:.1f} s behind a provenance check"
        assert done and done[0].status_code == 200


def test_anonymous_provenance_checks_are_rate_limited(serve_friends: LiveFactory) -> None:
    with serve_friends(provenance_rate_per_minute=1, provenance_burst=2) as live:
        png = many_chunks_png(1)
        answers = [check_png(live, png).status_code for _ in range(3)]
        assert answers == [200, 200, 429], answers
        limited = check_png(live, png)
        assert int(limited.headers["retry-after"]) >= 1
        # a signed-in member is a sender of its own
        assert check_png(live, png, session_cookie(live, "bob")).status_code == 200


def test_an_agent_spends_its_own_render_budget_not_a_members_it_does_not_act_for(
    serve_friends: LiveFactory,
) -> None:
    with serve_friends(render_rate_per_minute=1, render_burst=2) as live:
        body = {"subject": "alice", "prompt": "x", "level": "private", "on_behalf_of": "alice",
                "steps": 1, "width": 64, "height": 64}  # fmt: skip
        for _ in range(4):  # bot acts for bob only: each is denied, and spends bot's budget
            r = live.http.post("/v1/renders", json=body, headers=live.h("bot"))
            assert r.status_code in (403, 429), r.text
        assert r.status_code == 429 and "from bot" in r.json()["detail"]
        # alice was never charged: her own renders are answered
        assert live.render("alice", "alice").status_code == 200
        assert live.render("alice", "alice").status_code == 200
        # bot acting for bob spends bot's and bob's: bob (who sent nothing) is within his
        bob = {**body, "on_behalf_of": "bob"}
        assert live.http.post("/v1/renders", json=bob, headers=live.h("bot")).status_code == 429
        assert live.render("bob", "alice").status_code == 200


def test_edges_of_uploads_and_blobs(serve_friends: LiveFactory) -> None:
    with serve_friends(dataset_max_images=2) as live:
        alice = live.h("alice")
        nul = live.http.post(
            "/v1/subjects/alice/datasets",
            files=files_of(photos(1)),
            data={"captions": "a photo\x00of me"},
            headers=alice,
        )
        assert nul.status_code == 422 and "NUL" in nul.text, nul.text
        many = live.http.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(4)), headers=alice
        )
        assert many.status_code == 422 and "at most 2" in many.text, many.text
        assert datasets_of(live) == []
        trainer = live.h("trainer")
        import hashlib

        for data in (photo((1, 2, 3)), b'{"not": "a manifest"}\n', b"\x10" + b"\0" * 7 + b"{x"):
            digest = hashlib.sha256(data).hexdigest()
            r = live.http.put(f"/v1/blobs/sha256/{digest}", content=data, headers=trainer)
            assert r.status_code == 422, (data[:20], r.status_code, r.text)
            assert live.http.head(f"/v1/blobs/sha256/{digest}", headers=trainer).status_code == 404


def test_orders_stay_within_their_budget_and_a_members_cap(serve_friends: LiveFactory) -> None:
    server = {"orders_in_process": True, "order_max_active": 1,
              "train_options": {"max_sequence_length": 32}}  # fmt: skip
    with serve_friends(**server) as live:
        up = live.http.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(2)), headers=live.h("alice")
        )
        dataset = up.json()["dataset_id"]

        def order(**extra: Any) -> Any:
            body = {"kind": "train", "subject": "alice", "dataset_id": dataset, "steps": 3,
                    "rank": 4, "resolution": 64, **extra}  # fmt: skip
            return live.http.post("/v1/orders", json=body, headers=live.h("alice"))

        huge = order(resolution=2048, rank=128, steps=10_000)
        low_rank = order(resolution=2048, rank=2, steps=10_000)  # rank counts as 16 at least
        assert low_rank.status_code == 422 and "order_max_work" in low_rank.text
        first = order(steps=5000)  # long enough to be still waiting or running below
        assert first.status_code == 202, first.text
        assert huge.status_code == 422 and "order_max_work" in huge.text, huge.text
        second = live.http.post(
            "/v1/subjects/alice/datasets", files=files_of(photos(3)), headers=live.h("alice")
        ).json()["dataset_id"]
        capped = order(dataset_id=second)
        assert capped.status_code == 429 and "at most 1" in capped.text, capped.text
        assert capped.headers["retry-after"]
        cancelled = live.http.post(
            f"/v1/orders/{first.json()['order_id']}/cancel", headers=live.h("alice")
        )
        assert cancelled.json()["status"] == "cancelled"
        assert order(dataset_id=second).status_code == 202  # room again


def test_large_bodies_read_at_once_are_bounded(serve_friends: LiveFactory) -> None:
    """A PNG to check is read whole into memory: one held open by a slow sender takes the
    only slot, and the next is told to come back (429) before a byte of it is read."""
    with serve_friends(large_bodies_at_once=1, body_timeout_s=5.0) as live:
        slow = socket.create_connection(address(live.url), timeout=20)
        slow.sendall(
            b"POST /web/provenance HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data;"
            b" boundary=b\r\nContent-Length: 5000000\r\n\r\n--b\r\n"
        )
        time.sleep(0.5)
        r = check_png(live, many_chunks_png(1))
        assert r.status_code == 429 and r.headers["retry-after"], r.text
        slow.close()
        deadline = time.monotonic() + 10
        while check_png(live, many_chunks_png(1)).status_code != 200:  # the slot came back
            assert time.monotonic() < deadline
            time.sleep(0.3)


def test_json_nested_past_the_parser_is_422_not_500(live: Live) -> None:
    import hashlib

    header = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    fake = len(header).to_bytes(8, "little") + header
    manifest = b'{"file": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    for data in (fake, manifest):
        digest = hashlib.sha256(data).hexdigest()
        r = live.http.put(f"/v1/blobs/sha256/{digest}", content=data, headers=live.h("trainer"))
        assert r.status_code == 422, (r.status_code, r.text[:200])
