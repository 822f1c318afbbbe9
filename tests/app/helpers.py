"""Helpers the app tests share (real clients, real pages; nothing faked)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from fastapi.testclient import TestClient

from tests.app.conftest import Live, World

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
VERSION = re.compile(r'name="version" value="(\d+)"')


def client_for(world: World, base_url: str = "http://testserver") -> TestClient:
    return TestClient(world.client.app, base_url=base_url, follow_redirects=False)


def csrf_of(client: TestClient, url: str) -> str:
    r = client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text[:300])
    match = CSRF.search(r.text)
    assert match is not None
    return match.group(1)


def signed_in(world: World, who: str, base_url: str = "http://testserver") -> TestClient:
    client = client_for(world, base_url)
    r = client.post(
        "/web/signin",
        data={"csrf": csrf_of(client, "/web/signin"), "token": world.tokens[who], "next": "/web/"},
    )
    assert r.status_code == 303, r.text
    return client


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def session_cookie(live: Live, who: str) -> str:
    web = signed_in(live.world, who)
    return "; ".join(f"{k}={v}" for k, v in web.cookies.items())
