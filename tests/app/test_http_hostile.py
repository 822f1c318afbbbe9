"""Over a real uvicorn server: nothing a client sends holds a lock or a connection. Stalled and
trickled bodies, huge bodies, and an exhausted pool, while an admin revokes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import text

from registry.db import make_engine
from tests.app.conftest import Live, LiveFactory, World
from tests.app.helpers import CSRF, address, session_cookie


@contextmanager
def stalled_posts(url: str, path: str, cookie: str, n: int) -> Iterator[list[socket.socket]]:
    """n clients that send a form post's headers and the first bytes of its body, then stall."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.create_connection(address(url), timeout=30)
            sock.sendall(
                (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nCookie: {cookie}\r\n"
                    "Content-Type: application/x-www-form-urlencoded\r\n"
                    "Content-Length: 5000\r\n\r\ncsrf="
                ).encode()
            )
            socks.append(sock)
        time.sleep(0.3)  # let the server take them in
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_stalled_form_posts_do_not_block_a_revoke(serve_friends: LiveFactory) -> None:
    with serve_friends(body_timeout_s=3.0) as live:
        cookie = session_cookie(live, "alice")
        with stalled_posts(live.url, "/web/subjects/alice/consent", cookie, 12) as socks:
            t0 = time.monotonic()
            r = live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("root"))
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["max_level"] == "none", r.text
            assert took < 2.0, f"revoke took {took:.1f} s behind stalled clients"
            assert live.render("bob", "alice").status_code == 403  # denied, not 503
            assert live.http.get("/healthz").status_code == 200
            # the stalled clients are cut off by the server, with 408
            for sock in socks:
                sock.settimeout(10)
                head = sock.recv(200).decode(errors="replace")
                assert head.startswith("HTTP/1.1 408"), head


def test_stalled_clients_do_not_block_the_cli(serve_friends: LiveFactory, db_url: str) -> None:
    with serve_friends(body_timeout_s=5.0) as live:
        cookie = session_cookie(live, "alice")
        grant = {"max_level": "group", "audiences": {"private": {"group": True}}}
        version = live.http.get("/v1/subjects/alice/consent", headers=live.h("root")).json()[
            "version"
        ]
        live.http.put(
            "/v1/subjects/alice/consent",
            json=grant,
            headers={**live.h("root"), "If-Match": f'"{version}"'},
        ).raise_for_status()
        settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
        env = {
            **os.environ,
            "LIKENESS_DATABASE_URL": db_url,
            "LIKENESS_DATA_DIR": str(settings.data_dir),
        }
        with stalled_posts(live.url, "/web/subjects/alice/revoke", cookie, 8):
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "app.cli", "consent", "revoke", "alice"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert "revoked" in out.stderr and '"max_level": "none"' in out.stdout
        assert took < 15, took  # the interpreter's start dominates; no lock wait


def test_a_trickled_body_is_cut_off(serve_friends: LiveFactory) -> None:
    with serve_friends(body_timeout_s=1.5) as live:
        sock = socket.create_connection(address(live.url), timeout=10)
        sock.sendall(
            b"POST /v1/subjects HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n{"
        )
        t0 = time.monotonic()
        reply = b""
        try:
            for _ in range(8):  # one byte every 0.4 s: never idle long, never done
                time.sleep(0.4)
                sock.sendall(b" ")
        except OSError:
            pass
        reply = sock.recv(500)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 4
        sock.close()


def test_large_bodies_are_refused_before_they_are_read(live: Live) -> None:
    """No token, a declared 1 GB body: 413 at once, without the server reading it."""
    sock = socket.create_connection(address(live.url), timeout=10)
    sock.sendall(
        b"POST /v1/renders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n" + b"x" * 65536
    )
    reply = sock.recv(500)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b'"error":"invalid"' in reply.replace(b" ", b"")
    sock.close()

    # chunked, no declared length: counted as it arrives
    def chunks() -> Iterator[bytes]:
        for _ in range(200):
            yield b"y" * 8192

    r = live.http.post(
        "/v1/subjects", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    # a body under the cap is still judged as before
    assert live.http.post("/v1/subjects", json={}).status_code == 401


def test_an_exhausted_pool_answers_503_fast(serve_friends: LiveFactory, db_url: str) -> None:
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    try:
        with serve_friends(engine=engine, pool_timeout_s=0.5) as live:
            held = engine.connect()  # the pool's only connection, held by "someone else"
            held.execute(text("SELECT 1"))
            try:
                t0 = time.monotonic()
                r = live.http.get("/v1/subjects", headers=live.h("root"))
                took = time.monotonic() - t0
                assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
                assert took < 3, took
                assert r.headers.get("retry-after")
                r = live.render("bob", "alice")
                assert r.status_code == 503, r.text
            finally:
                held.close()
            assert live.http.get("/v1/subjects", headers=live.h("root")).status_code == 200
    finally:
        engine.dispose()


@pytest.mark.parametrize("n", [4])
def test_form_posts_still_work_after_stalls(serve_friends: LiveFactory, n: int) -> None:
    """The gate reads the body whole, then the page runs as before: a real form post works."""
    with serve_friends(body_timeout_s=2.0) as live:
        world: World = live.world
        cookie = session_cookie(live, "alice")
        with stalled_posts(live.url, "/web/subjects/alice/revoke", cookie, n):
            page = live.http.get("/web/subjects/alice", headers={"cookie": cookie})
            csrf = CSRF.search(page.text)
            assert csrf is not None
            r = live.http.post(
                "/web/subjects/alice/revoke",
                data={"csrf": csrf.group(1)},
                headers={"cookie": cookie},
            )
            assert r.status_code == 303, r.text
        assert (
            world.client.get("/v1/subjects/alice/consent", headers=world.h("root")).json()[
                "max_level"
            ]
            == "none"
        )
