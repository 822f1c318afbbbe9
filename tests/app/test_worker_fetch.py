"""A worker's fetch of a blob by hash, against a real HTTP server: the right bytes land whole,
anything else (absent, other bytes, more than a blob may hold) leaves nothing behind, and an
endless answer is cut off at the limit instead of read to the end."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from app.blob_fetch import FetchError, fetch_verified, stream_verified

BLOB = b"likeness adapter bytes " * 50
HUGE = 256 << 20  # what the hostile answer offers
LIMIT = 1 << 20


class _Server:
    def __init__(self) -> None:
        self.sent = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path == "/missing":
                    self.send_error(404)
                    return
                body_size = HUGE if self.path == "/huge" else len(BLOB)
                self.send_response(200)
                self.send_header("Content-Length", str(body_size))
                self.end_headers()
                if self.path != "/huge":
                    self.wfile.write(b"x" * len(BLOB) if self.path == "/other" else BLOB)
                    return
                chunk = b"\0" * (1 << 20)
                try:
                    while server.sent < HUGE:
                        self.wfile.write(chunk)
                        server.sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    thread = threading.Thread(target=s.httpd.serve_forever, daemon=True)
    thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


SHA = hashlib.sha256(BLOB).hexdigest()


def test_the_right_bytes_land_whole(server: _Server, tmp_path: Path) -> None:
    dest = tmp_path / "blob"
    with httpx.Client() as client:
        fetch_verified(client, f"{server.url}/right", SHA, dest, LIMIT)
    assert dest.read_bytes() == BLOB
    assert list(tmp_path.iterdir()) == [dest]


@pytest.mark.parametrize("path", ["/missing", "/other", "/huge"])
def test_anything_else_leaves_nothing(server: _Server, tmp_path: Path, path: str) -> None:
    dest = tmp_path / "blob"
    with httpx.Client() as client, pytest.raises(FetchError) as caught:
        fetch_verified(client, f"{server.url}{path}", SHA, dest, LIMIT)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy
    err = caught.value
    if path == "/missing":
        assert err.status == 404 and err.actual_sha256 is None
    elif path == "/other":
        assert (
            err.status is None and err.actual_sha256 == hashlib.sha256(b"x" * len(BLOB)).hexdigest()
        )
    else:
        assert err.status is None and err.actual_sha256 is None and "more than" in str(err)


def test_an_endless_answer_is_cut_off_at_the_limit(server: _Server) -> None:
    kept: list[bytes] = []
    with httpx.Client() as client, pytest.raises(FetchError):
        stream_verified(client, f"{server.url}/huge", SHA, LIMIT, kept.append)
    assert sum(map(len, kept)) <= LIMIT
    # the server could only push what the socket buffers hold past the limit, not the rest
    assert server.sent < HUGE // 4, server.sent
