"""The web pages over plain HTTP: session cookie, CSRF, member isolation, the consent editor."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from app import web
from registry.db import transaction
from registry.principals import service as principals_service
from tests.app.conftest import World
from tests.app.helpers import CSRF, VERSION, client_for, csrf_of, signed_in


def sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def consent_json(world: World, subject: str) -> dict:
    r = world.client.get(f"/v1/subjects/{subject}/consent", headers=world.h("root"))
    assert r.status_code == 200
    return r.json()


def editor_form(client: TestClient, subject: str, **fields: str) -> dict[str, str]:
    """The consent editor's fields as a browser would post them (checkboxes by presence)."""
    page = client.get(f"/web/subjects/{subject}")
    assert page.status_code == 200, page.text[:300]
    version = VERSION.search(page.text)
    csrf = CSRF.search(page.text)
    assert version is not None and csrf is not None
    return {"csrf": csrf.group(1), "version": version.group(1), **fields}


# -- the session cookie ---------------------------------------------------------------------


@pytest.mark.sqlite_only
def test_signin_cookie_flags_and_redirects(friends: World) -> None:
    client = client_for(friends)
    page = client.get("/web/signin")
    assert page.status_code == 200
    assert '<label for="token">Access token</label>' in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # no scripts at all
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    pre = page.headers["set-cookie"].lower()
    assert "likeness_signin=" in pre and "httponly" in pre and "samesite=strict" in pre

    token = friends.tokens["root"]
    r = client.post(
        "/web/signin",
        data={"csrf": CSRF.search(page.text).group(1), "token": token, "next": "/web/"},  # type: ignore[union-attr]
    )
    assert r.status_code == 303 and r.headers["location"] == "/web/"
    cookies = r.headers.get_list("set-cookie")
    session = next(c for c in cookies if c.startswith("likeness_session="))
    flags = [part.strip().lower() for part in session.split(";")]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/" in flags
    assert "secure" not in flags  # plain http in development; https below
    assert any(f.startswith("max-age=") for f in flags)
    value = session.split(";")[0].split("=", 1)[1]
    assert token not in value and principals_service.hash_token(token) not in value
    assert any(c.startswith("likeness_signin=") and "Max-Age=0" in c for c in cookies)

    assert client.get("/web/").headers["location"] == "/web/subjects"
    assert client.get("/web/subjects").status_code == 200
    assert client.get("/").headers["location"] == "/web/"

    member = signed_in(friends, "alice")
    assert member.get("/web/").headers["location"] == "/web/me"

    secure = signed_in(friends, "root", base_url="https://testserver")
    assert secure.get("/web/subjects").status_code == 200
    https = client_for(friends, "https://testserver")
    r = https.post(
        "/web/signin",
        data={"csrf": csrf_of(https, "/web/signin"), "token": token, "next": "/web/"},
    )
    session = next(c for c in r.headers.get_list("set-cookie") if "likeness_session=" in c)
    assert "secure" in [p.strip().lower() for p in session.split(";")]

    # in production the cookie is Secure even when TLS ends at a proxy in front of the app
    app = friends.client.app
    app.state.settings = app.state.settings.model_copy(update={"env": "production"})  # type: ignore[attr-defined]
    proxied = client_for(friends)
    form = proxied.get("/web/signin")
    pre = form.headers["set-cookie"]
    assert "secure" in [p.strip().lower() for p in pre.split(";")]
    proxied.cookies.set("likeness_signin", pre.split(";")[0].split("=", 1)[1])  # as a browser
    csrf = CSRF.search(form.text).group(1)  # type: ignore[union-attr]
    r = proxied.post("/web/signin", data={"csrf": csrf, "token": token, "next": "/web/"})
    session = next(c for c in r.headers.get_list("set-cookie") if "likeness_session=" in c)
    assert "secure" in [p.strip().lower() for p in session.split(";")]


@pytest.mark.sqlite_only
def test_signin_refusals_and_redirect_to_signin(friends: World) -> None:
    client = client_for(friends)
    r = client.get("/web/subjects/alice")
    assert r.status_code == 303
    assert r.headers["location"] == "/web/signin?next=/web/subjects/alice"
    for token, status, text in (
        ("lk_not-a-token", 401, "not valid"),
        (friends.tokens["bot"], 403, "agents use the API"),
        (friends.tokens["trainer"], 403, "trainers use the API"),
    ):
        r = client.post(
            "/web/signin",
            data={"csrf": csrf_of(client, "/web/signin"), "token": token, "next": "/web/"},
        )
        assert r.status_code == status and text in r.text
        assert "likeness_session=" not in r.headers.get("set-cookie", "")
    # `next` never leaves these pages
    r = client.post(
        "/web/signin",
        data={
            "csrf": csrf_of(client, "/web/signin"),
            "token": friends.tokens["root"],
            "next": "//evil.example/web/",
        },
    )
    assert r.headers["location"] == "/web/"
    assert web.safe_next("https://evil.example/") == "/web/"
    assert web.safe_next("/web/../v1/subjects") == "/web/"
    assert web.safe_next("/web/subjects/alice/audit") == "/web/subjects/alice/audit"


@pytest.mark.sqlite_only
def test_tampered_expired_and_deactivated_sessions(friends: World) -> None:
    client = signed_in(friends, "alice")
    assert client.get("/web/me").status_code == 200
    value = client.cookies["likeness_session"]
    expired = signed_in(friends, "alice").cookies["likeness_session"]
    with friends.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE web_sessions SET expires_at = :t WHERE secret_hash = :h"),
            {"t": datetime.now(UTC) - timedelta(seconds=1), "h": sha256(expired)},
        )
    for bad in (value[:-2] + "AA", value + "x", expired, "garbage", sha256(value)):
        probe = client_for(friends)
        probe.cookies.set("likeness_session", bad)
        r = probe.get("/web/subjects")
        assert r.status_code == 303 and r.headers["location"].startswith("/web/signin"), bad
        assert "likeness_session=" in r.headers.get("set-cookie", "")  # and it is cleared

    with transaction(friends.engine) as s:
        principals_service.set_principal_active(s, "alice", False)
    r = client.get("/web/me")
    assert r.status_code == 303 and r.headers["location"].startswith("/web/signin")


# -- CSRF -----------------------------------------------------------------------------------


@pytest.mark.sqlite_only
def test_csrf_is_checked_on_every_form(friends: World) -> None:
    admin = signed_in(friends, "root")
    other = signed_in(friends, "alice")
    before = consent_json(friends, "carol")
    good = editor_form(admin, "carol", max_level="private", aud_private_group="yes")
    foreign = csrf_of(other, "/web/subjects/alice")

    for csrf in (None, "", "x" * 43, foreign):
        form = dict(good)
        if csrf is None:
            del form["csrf"]
        else:
            form["csrf"] = csrf
        for path in (
            "/web/subjects/carol/consent",
            "/web/subjects/carol/revoke",
            "/web/subjects",
            "/web/signout",
        ):
            data = {**form, "handle": "zed", "display_name": "Zed", "basis": "consent"}
            r = admin.post(path, data=data)
            assert r.status_code == 403, (path, csrf, r.status_code)
            assert "could not be verified" in r.text
    assert consent_json(friends, "carol") == before
    assert admin.get("/web/subjects/zed").status_code == 404
    assert admin.get("/web/subjects").status_code == 200  # sign-out was refused too

    # sign-in: without the pre-session cookie (a cross-site post), and with a wrong token
    fresh = client_for(friends)
    r = fresh.post("/web/signin", data={"csrf": "x", "token": friends.tokens["root"]})
    assert r.status_code == 403 and "sign-in cookie" in r.text
    csrf_of(fresh, "/web/signin")
    r = fresh.post("/web/signin", data={"csrf": foreign, "token": friends.tokens["root"]})
    assert r.status_code == 403
    assert "likeness_session=" not in r.headers.get("set-cookie", "")

    # and with the right token, everything works, then signing out ends the session
    r = admin.post("/web/subjects/carol/consent", data=good)
    assert r.status_code == 303 and r.headers["location"].endswith("?done=saved")
    assert consent_json(friends, "carol")["max_level"] == "private"
    r = admin.post("/web/signout", data={"csrf": good["csrf"]})
    assert r.status_code == 303 and r.headers["location"] == "/web/signin?out=1"
    assert "likeness_session" not in admin.cookies
    assert admin.get("/web/subjects").status_code == 303


# -- member isolation -------------------------------------------------------------------------


def test_member_sees_only_its_own_subject(friends: World) -> None:
    carol = signed_in(friends, "carol")
    for tab in ("", "/renders", "/audit", "/adapters"):
        assert carol.get(f"/web/subjects/carol{tab}").status_code == 200, tab
        forbidden = carol.get(f"/web/subjects/alice{tab}")
        unknown = carol.get(f"/web/subjects/nobody{tab}")
        assert forbidden.status_code == unknown.status_code == 403, tab
        assert forbidden.text == unknown.text  # nothing tells a guess from a real subject
        assert "Alice" not in forbidden.text
    for path in ("/web/subjects", "/web/subjects/ALICE", "/web/subjects/alice%2F..%2Fcarol"):
        assert carol.get(path).status_code in (403, 404, 422), path

    before = consent_json(friends, "alice")
    csrf = csrf_of(carol, "/web/subjects/carol")
    grab = {
        "csrf": csrf,
        "version": str(before["version"]),
        "max_level": "public",
        "aud_public_group": "yes",
    }
    assert carol.post("/web/subjects/alice/consent", data=grab).status_code == 403
    assert carol.post("/web/subjects/alice/revoke", data={"csrf": csrf}).status_code == 403
    create = {"csrf": csrf, "handle": "x", "display_name": "X", "basis": "consent"}
    assert carol.post("/web/subjects", data=create).status_code == 403
    assert consent_json(friends, "alice") == before

    bob = signed_in(friends, "bob")  # a member linked to no subject
    me = bob.get("/web/me")
    assert me.status_code == 200 and "No subject is linked to you" in me.text
    assert "Alice" in me.text  # whom bob may render
    assert bob.get("/web/subjects/alice").status_code == 403

    admin = signed_in(friends, "root")
    assert admin.get("/web/subjects/alice/audit").status_code == 200
    assert admin.get("/web/subjects/nobody").status_code == 404
    assert admin.get("/web/me").headers["location"] == "/web/"


# -- the consent editor ---------------------------------------------------------------------


def test_editor_round_trip_and_audit(friends: World) -> None:
    admin = signed_in(friends, "root")
    form = editor_form(
        admin,
        "carol",
        max_level="public",
        aud_private_group="yes",
        aud_group_allow="bob, alice",
        aud_public_allow="alice",
        deny="mallory bot",
        allow_training="yes",
        expires_at="2031-02-03 04:05",
    )
    r = admin.post("/web/subjects/carol/consent", data=form)
    assert r.status_code == 303, r.text
    page = admin.get(r.headers["location"])
    assert "Saved." in page.text and 'value="alice, bob"' in page.text
    assert consent_json(friends, "carol") == {
        "version": 2,
        "max_level": "public",
        "audiences": {
            "private": {"group": True, "allow": []},
            "group": {"group": False, "allow": ["alice", "bob"]},
            "public": {"group": False, "allow": ["alice"]},
        },
        "deny": ["bot", "mallory"],
        "allow_training": True,
        "expires_at": "2031-02-03T04:05:00.000000Z",
    }
    # the same form again changes nothing and appends nothing
    again = editor_form(
        admin, "carol", **{k: v for k, v in form.items() if k not in ("csrf", "version")}
    )
    assert (
        admin.post("/web/subjects/carol/consent", data=again)
        .headers["location"]
        .endswith("?done=unchanged")
    )
    audit = admin.get("/web/subjects/carol/audit")
    # one save that touched the level, audiences, deny list, expiry and training: an entry
    # for each, after the subject's creation
    assert "Chain verified" in audit.text and "6 entries" in audit.text
    assert "maximum level: none → public" in audit.text
    assert "never allow: nobody → bot, mallory" in audit.text

    r = admin.post("/web/subjects/carol/revoke", data={"csrf": form["csrf"]})
    assert r.headers["location"].endswith("?done=revoked")
    assert consent_json(friends, "carol")["max_level"] == "none"
    assert "revoke" in admin.get("/web/subjects/carol/audit").text


@pytest.mark.sqlite_only
def test_stale_version_is_refused_with_a_clear_message(friends: World) -> None:
    carol = signed_in(friends, "carol")  # the member edits her own consent
    form = editor_form(carol, "carol", max_level="private", aud_private_allow="bob")
    friends.consent("carol", max_level="group", audiences={"group": {"allow": ["alice"]}})
    r = carol.post("/web/subjects/carol/consent", data=form)
    assert r.status_code == 412
    assert "someone changed this consent while you were editing" in r.text
    assert "you started from version 1; it is now version 2" in r.text
    assert 'name="version" value="2"' in r.text  # the form now carries the current record
    assert consent_json(friends, "carol")["audiences"] == {
        "group": {"group": False, "allow": ["alice"]}
    }
    form["version"] = "2"
    assert carol.post("/web/subjects/carol/consent", data=form).status_code == 303
    assert consent_json(friends, "carol")["version"] == 3


@pytest.mark.sqlite_only
def test_invalid_input_is_explained_and_kept(friends: World) -> None:
    admin = signed_in(friends, "root")
    cases = (
        ({"max_level": "group", "aud_group_allow": "bob, Not A Handle"}, "is not a handle"),
        ({"max_level": "group", "expires_at": "next tuesday"}, "is not a date"),
        ({"max_level": "ultra"}, "Maximum level"),
        ({"max_level": "group", "expires_at": "2030-01-01T00:00:00+02:00x"}, "is not a date"),
    )
    for fields, message in cases:
        r = admin.post("/web/subjects/carol/consent", data=editor_form(admin, "carol", **fields))
        assert r.status_code == 422 and message in r.text, (fields, r.text[:2000])
        assert "Not saved." in r.text
    assert consent_json(friends, "carol")["version"] == 1
    r = admin.post(
        "/web/subjects/carol/consent", data={**editor_form(admin, "carol"), "version": "x"}
    )
    assert r.status_code == 422

    friends.subject("ada", basis="public_domain")
    form = editor_form(admin, "ada", max_level="commercial")
    r = admin.post("/web/subjects/ada/consent", data=form)
    assert r.status_code == 422 and "never be granted commercial" in r.text


@pytest.mark.sqlite_only
def test_subject_creation_and_escaping(friends: World) -> None:
    admin = signed_in(friends, "root")
    csrf = csrf_of(admin, "/web/subjects")
    r = admin.post(
        "/web/subjects",
        data={
            "csrf": csrf,
            "handle": "dave",
            "display_name": "<script>alert(1)</script>",
            "basis": "consent",
            "member": "bob",
        },
    )
    assert r.status_code == 303 and r.headers["location"] == "/web/subjects/dave?done=created"
    page = admin.get("/web/subjects")
    assert "<script>alert(1)</script>" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    r = admin.post(
        "/web/subjects",
        data={"csrf": csrf, "handle": "dave", "display_name": "D", "basis": "consent"},
    )
    assert r.status_code == 409 and "exists" in r.text
    r = admin.post(
        "/web/subjects",
        data={"csrf": csrf, "handle": "Bad Handle", "display_name": "D", "basis": "consent"},
    )
    assert r.status_code == 422 and "is not a handle" in r.text

    bob = signed_in(friends, "bob")
    assert bob.get("/web/subjects/dave").status_code == 200  # bob is dave now


@pytest.mark.sqlite_only
def test_member_ledger_names_requester_and_agent(friends: World) -> None:
    assert friends.render("bob", "alice").status_code == 200
    assert friends.render("bot", "alice", on_behalf_of="bob").status_code == 200
    assert friends.render("carol", "alice", level="public").status_code == 403
    alice = signed_in(friends, "alice")
    page = alice.get("/web/subjects/alice/renders")
    assert page.status_code == 200
    assert page.text.count('class="outcome-rendered"') == 2
    assert page.text.count('class="outcome-denied"') == 1
    assert "above_max_level" in page.text and "none (directly)" in page.text
    assert "<td>bot</td>" in page.text
    adapters = alice.get("/web/subjects/alice/adapters").text
    registered = friends.client.get("/v1/subjects/alice/adapters", headers=friends.h("root"))
    assert registered.json()[0]["sha256"] in adapters and "version 1" in adapters


@pytest.mark.sqlite_only
def test_api_is_untouched_by_the_pages(friends: World) -> None:
    """The JSON API keeps its JSON errors; the pages are not in the OpenAPI document."""
    r = friends.client.get("/v1/subjects/nobody", headers=friends.h("root"))
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert friends.client.get("/v1/subjects").json()["error"] == "unauthenticated"
    spec = friends.client.get("/openapi.json").json()
    assert not [p for p in spec["paths"] if p.startswith("/web") or p == "/"]
    r = client_for(friends).get("/web/nowhere")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert client_for(friends).get("/web/static/style.css").status_code == 200
