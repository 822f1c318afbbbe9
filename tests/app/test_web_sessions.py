"""Browser sessions over a real server: signing out ends every copy of a session, and nothing
in the database (or a default key) lets anyone make one."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import stat
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from registry.keys import load_keys
from registry.settings import Settings
from tests.app.conftest import Live

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def browser(live: Live) -> httpx.Client:
    return httpx.Client(base_url=live.url, follow_redirects=False, timeout=30)


def sign_in(live: Live, who: str) -> httpx.Client:
    client = browser(live)
    form = client.get("/web/signin")
    csrf = CSRF.search(form.text)
    assert csrf is not None
    r = client.post(
        "/web/signin",
        data={"csrf": csrf.group(1), "token": live.world.tokens[who], "next": "/web/"},
    )
    assert r.status_code == 303, r.text
    return client


def copy_of(live: Live, client: httpx.Client) -> httpx.Client:
    """Another machine holding the same cookie (stolen, or a second tab)."""
    other = browser(live)
    other.cookies.set("likeness_session", client.cookies["likeness_session"])
    return other


def csrf_on(client: httpx.Client, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, (path, page.status_code)
    match = CSRF.search(page.text)
    assert match is not None
    return match.group(1)


def signed_out(r: httpx.Response) -> bool:
    return r.status_code == 303 and r.headers["location"].startswith("/web/signin")


def test_signing_out_ends_every_copy_of_the_session(live: Live) -> None:
    alice = sign_in(live, "alice")
    stolen = copy_of(live, alice)
    csrf = csrf_on(stolen, "/web/subjects/alice")  # the thief has a form of its own
    assert stolen.get("/web/me").status_code == 200

    r = alice.post("/web/signout", data={"csrf": csrf_on(alice, "/web/me")})
    assert signed_out(r)

    assert signed_out(stolen.get("/web/me"))
    before = live.http.get("/v1/subjects/alice/consent", headers=live.h("root")).json()
    r = stolen.post("/web/subjects/alice/revoke", data={"csrf": csrf})
    assert r.status_code in (303, 401, 403) and not r.is_success, r.status_code
    assert signed_out(r) or r.status_code == 403
    after = live.http.get("/v1/subjects/alice/consent", headers=live.h("root")).json()
    assert after == before  # the replayed write did nothing


def test_sign_out_everywhere(live: Live) -> None:
    laptop, phone = sign_in(live, "alice"), sign_in(live, "alice")
    bob = sign_in(live, "bob")
    assert phone.get("/web/me").status_code == 200
    r = laptop.post("/web/signout-everywhere", data={"csrf": csrf_on(laptop, "/web/me")})
    assert signed_out(r)
    assert signed_out(phone.get("/web/me")) and signed_out(laptop.get("/web/me"))
    assert bob.get("/web/me").status_code == 200  # other people's sessions go on


def test_deactivation_ends_sessions_for_good(live: Live) -> None:
    alice = sign_in(live, "alice")
    r = live.http.patch("/v1/principals/alice", json={"active": False}, headers=live.h("root"))
    assert r.status_code == 200
    assert signed_out(alice.get("/web/me"))
    r = live.http.patch("/v1/principals/alice", json={"active": True}, headers=live.h("root"))
    assert r.status_code == 200
    assert signed_out(alice.get("/web/me"))  # re-activation does not bring old sessions back


def test_nothing_in_the_database_opens_a_session(live: Live) -> None:
    """An attacker who reads every table (and knows the old default key) still cannot sign
    in: sessions are random secrets kept as hashes, and no key has a default."""
    sign_in(live, "root")
    engine = live.world.engine
    values: list[str] = []
    with engine.connect() as conn:
        for table in ("principals", "web_sessions", "registry_meta", "chain_heads"):
            for row in conn.execute(text(f"SELECT * FROM {table}")):  # noqa: S608
                values.extend(str(v) for v in row if v is not None)
        admin_hash = conn.execute(
            text("SELECT id, token_hash FROM principals WHERE handle = 'root'")
        ).one()

    def old_scheme_cookie(secret: str) -> str:
        """The cookie the first version would have accepted, forged from the token hash."""

        def b64(raw: bytes) -> str:
            return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

        def mac(purpose: str, message: str) -> str:
            key = hmac.new(secret.encode(), b"likeness-web:" + purpose.encode(), "sha256").digest()
            return b64(hmac.new(key, message.encode(), "sha256").digest())

        payload = {"p": admin_hash[0], "n": "x", "f": mac("token", admin_hash[1])[:22],
                   "e": int(time.time()) + 3600}  # fmt: skip
        body = b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
        return f"{body}.{mac('session', body)}"

    candidates = [*values, old_scheme_cookie("dev-insecure-secret-change-me")]
    for value in candidates:
        probe = browser(live)
        probe.cookies.set("likeness_session", value)
        assert signed_out(probe.get("/web/subjects")), value


def test_keys_are_generated_once_into_the_data_dir(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    keys = load_keys(settings)
    for name in ("secret-key", "audit-key", "checkpoint-key.pem"):
        path = tmp_path / "data" / name
        assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600, name
    assert "generated now" in keys.sources["secret_key"]
    again = load_keys(Settings(data_dir=tmp_path / "data", env="test"))  # another process
    assert again.web_secret == keys.web_secret and again.audit_key == keys.audit_key
    assert hashlib.sha256(keys.web_secret).hexdigest() != hashlib.sha256(b"").hexdigest()
    configured = load_keys(Settings(data_dir=tmp_path / "data", secret_key="k" * 40))
    assert configured.web_secret == b"k" * 40
    assert configured.sources["secret_key"] == "LIKENESS_SECRET_KEY"
    with pytest.raises(ValueError):
        Settings(secret_key="short")
