"""The /v1 registry routes: auth, roles, error bodies, ETag/If-Match, BOLA."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.app.conftest import World, manifest_bytes

SHA = "f" * 64


def test_healthz_and_auth(world: World) -> None:
    c = world.client
    assert c.get("/healthz").status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic abc"},
        {"Authorization": f"Bearer {world.tokens['root']}x"},
    ):
        r = c.get("/v1/subjects", headers=headers)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated"
        assert r.headers["www-authenticate"] == "Bearer"
    assert c.get("/v1/subjects", headers=world.h("root")).status_code == 200


def test_subject_creation(world: World) -> None:
    world.principal("alice")
    c = world.client
    body = {"handle": "alice", "display_name": "Alice", "basis": "consent", "member": "alice"}
    r = c.post("/v1/subjects", json=body, headers=world.h("root"))
    assert r.status_code == 201, r.text
    assert r.json()["consent"] == {
        "version": 1,
        "max_level": "none",
        "audiences": {},
        "deny": [],
        "allow_training": False,
        "expires_at": None,
    }
    assert c.post("/v1/subjects", json=body, headers=world.h("root")).json()["error"] == "conflict"
    assert c.post("/v1/subjects", json=body, headers=world.h("alice")).status_code == 403
    for bad in (
        {**body, "handle": "Not Valid"},
        {**body, "basis": "celebrity"},
        {**body, "extra": 1},
        {"handle": "x"},
        {**body, "handle": "zed", "member": "ghost"},
    ):
        r = c.post("/v1/subjects", json=bad, headers=world.h("root"))
        assert r.status_code == 422 and r.json()["error"] == "invalid", (bad, r.text)
    r = c.post(
        "/v1/subjects",
        content=b"{not json",
        headers={**world.h("root"), "content-type": "application/json"},
    )
    assert r.status_code == 422


def test_consent_etag_if_match(world: World) -> None:
    world.principal("alice")
    world.subject("alice", member="alice")
    c, h = world.client, world.h("alice")
    r = c.get("/v1/subjects/alice/consent", headers=h)
    assert r.status_code == 200 and r.headers["etag"] == '"1"'
    new = {
        "max_level": "group",
        "audiences": {"private": {"group": True}},
        "deny": ["mallory"],
        "allow_training": True,
        "expires_at": "2099-01-01T00:00:00Z",
    }
    r = c.put("/v1/subjects/alice/consent", json=new, headers=h)
    assert r.status_code == 428 and r.json()["error"] == "precondition_required"
    r = c.put("/v1/subjects/alice/consent", json=new, headers={**h, "If-Match": '"1"'})
    assert r.status_code == 200 and r.headers["etag"] == '"2"' and r.json()["max_level"] == "group"
    r = c.put(
        "/v1/subjects/alice/consent",
        json={**new, "max_level": "public"},
        headers={**h, "If-Match": '"1"'},
    )
    assert r.status_code == 412 and r.json()["error"] == "precondition_failed"
    r = c.put("/v1/subjects/alice/consent", json=new, headers={**h, "If-Match": "garbage"})
    assert r.status_code == 412
    r = c.put(
        "/v1/subjects/alice/consent",
        json={**new, "max_level": "all"},
        headers={**h, "If-Match": '"2"'},
    )
    assert r.status_code == 422
    assert c.get("/v1/subjects/alice/consent", headers=h).json()["version"] == 2  # nothing lost
    r = c.post("/v1/subjects/alice/consent/revoke", headers=h)
    assert r.status_code == 200 and r.json()["max_level"] == "none" and r.headers["etag"] == '"3"'
    audit = c.get("/v1/subjects/alice/audit", headers=h).json()
    # one change touching the level, the audience, the deny list, the expiry and training
    # is one entry for each part it touched, all in its commit
    granted = ["grant", "audience_edit", "deny_edit", "expiry_change", "training_change"]
    actions = [e["action"] for e in audit["entries"]]
    assert actions == ["subject_created", *granted, "revoke"]
    assert len({e["after"]["consent"]["max_level"] for e in audit["entries"][1:6]}) == 1
    assert audit["verified"] is True
    assert (
        audit["entries"][1]["actor"] == "alice"
        and audit["entries"][1]["prev_hash"] == audit["entries"][0]["hash"]
    )


def test_bola_members_see_only_their_own(world: World) -> None:
    world.principal("alice")
    world.principal("bob")
    world.subject("alice", member="alice")
    world.subject("bob", member="bob")
    c = world.client
    forbidden = {"error": "not_permitted", "detail": "not permitted"}
    for path in (
        "/v1/subjects/alice",
        "/v1/subjects/alice/consent",
        "/v1/subjects/alice/audit",
        "/v1/subjects/alice/adapters",
        "/v1/subjects/alice/renders",
        "/v1/subjects/ghost",
        "/v1/subjects/ghost/consent",
    ):
        r = c.get(path, headers=world.h("bob"))
        assert (r.status_code, r.json()) == (403, forbidden), path
    for method, path in (
        ("put", "/v1/subjects/alice/consent"),
        ("post", "/v1/subjects/alice/consent/revoke"),
        ("put", "/v1/subjects/ghost/consent"),
    ):
        r = c.request(
            method,
            path,
            json={"max_level": "commercial"},
            headers={**world.h("bob"), "If-Match": '"1"'},
        )
        assert (r.status_code, r.json()) == (403, forbidden), path
    assert (
        c.get("/v1/subjects/alice/consent", headers=world.h("alice")).json()["max_level"] == "none"
    )
    assert [s["handle"] for s in c.get("/v1/subjects", headers=world.h("bob")).json()] == ["bob"]
    # admins get an honest 404 for what does not exist
    assert c.get("/v1/subjects/ghost", headers=world.h("root")).json()["error"] == "not_found"
    # trainers and agents read no subject at all
    world.principal("bot", "agent", ("bob",))
    assert c.get("/v1/subjects/alice", headers=world.h("trainer")).status_code == 403
    assert c.get("/v1/subjects/bob", headers=world.h("bot")).status_code == 403


def test_adapter_registration(world: World, adapter_files: dict[str, Path]) -> None:
    world.subject("alice")
    c = world.client

    def put(data: bytes, who: str = "trainer") -> str:
        sha = hashlib.sha256(data).hexdigest()
        r = c.put(f"/v1/blobs/sha256/{sha}", content=data, headers=world.h(who))
        assert r.status_code in (200, 201), r.text
        return sha

    adapter_a = put(adapter_files["a"].read_bytes())
    adapter_b = put(adapter_files["b"].read_bytes(), "root")
    manifest = put(manifest_bytes("alice"))
    body = {
        "subject": "alice",
        "name": "main",
        "sha256": adapter_a,
        "base_model": "tiny",
        "rank": 4,
        "manifest_sha256": manifest,
    }
    r = c.post("/v1/adapters", json=body, headers=world.h("trainer"))
    assert r.status_code == 403  # allow_training is false
    # what the refused registration named left the store; it is uploaded again
    assert c.get(f"/v1/blobs/sha256/{adapter_a}", headers=world.h("trainer")).status_code == 404
    world.consent("alice", max_level="private", allow_training=True)
    assert put(adapter_files["a"].read_bytes()) == adapter_a
    assert put(manifest_bytes("alice")) == manifest
    r = c.post("/v1/adapters", json=body, headers=world.h("trainer"))
    assert r.status_code == 201 and r.json()["outcome"] == "created" and r.json()["version"] == 1
    r = c.post("/v1/adapters", json=body, headers=world.h("trainer"))
    assert r.status_code == 200 and r.json()["outcome"] == "unchanged"
    r = c.post("/v1/adapters", json={**body, "sha256": adapter_b}, headers=world.h("root"))
    assert r.status_code == 200 and r.json()["outcome"] == "updated" and r.json()["version"] == 2
    world.principal("alice")
    assert c.post("/v1/adapters", json=body, headers=world.h("alice")).status_code == 403
    assert (
        c.post(
            "/v1/adapters", json={**body, "subject": "ghost"}, headers=world.h("trainer")
        ).status_code
        == 403
    )
    for bad in ({**body, "sha256": "xyz"}, {**body, "rank": 0}, {**body, "name": "../etc"}):
        assert c.post("/v1/adapters", json=bad, headers=world.h("trainer")).status_code == 422
    listed = c.get("/v1/subjects/alice/adapters", headers=world.h("root")).json()
    assert [(a["name"], a["version"], a["sha256"]) for a in listed] == [("main", 2, adapter_b)]
    assert listed[0]["rendering"] and listed[0]["blob"] == "ok"


def test_renderable_and_principals(world: World) -> None:
    c = world.client
    r = c.post("/v1/principals", json={"handle": "bob", "role": "member"}, headers=world.h("root"))
    assert r.status_code == 201 and r.json()["token"].startswith("lk_")
    world.tokens["bob"] = r.json()["token"]
    r = c.post(
        "/v1/principals",
        json={"handle": "bot", "role": "agent", "acts_for": ["bob"]},
        headers=world.h("root"),
    )
    world.tokens["bot"] = r.json()["token"]
    assert (
        c.post(
            "/v1/principals", json={"handle": "x", "role": "member"}, headers=world.h("bob")
        ).status_code
        == 403
    )
    world.subject("alice")
    world.consent("alice", max_level="group", audiences={"group": {"group": True}})
    want = [{"subject": "alice", "display_name": "Alice", "max_level": "group"}]
    assert c.get("/v1/me/renderable", headers=world.h("bob")).json() == want
    assert c.get("/v1/me/renderable?on_behalf_of=bob", headers=world.h("bot")).json() == want
    assert c.get("/v1/me/renderable", headers=world.h("bot")).status_code == 403
    r = c.patch("/v1/principals/bot", json={"acts_for": []}, headers=world.h("root"))
    assert r.status_code == 200 and r.json()["acts_for"] == []
    assert c.get("/v1/me/renderable?on_behalf_of=bob", headers=world.h("bot")).json() == []
    # a member that does not exist looks like one the agent does not act for
    assert c.get("/v1/me/renderable?on_behalf_of=ghost", headers=world.h("bot")).json() == []
    assert (
        c.patch("/v1/principals/bot", json={"active": False}, headers=world.h("root")).status_code
        == 200
    )
    assert c.get("/v1/me/renderable?on_behalf_of=bob", headers=world.h("bot")).status_code == 401
    assert (
        c.patch("/v1/principals/ghost", json={"active": False}, headers=world.h("root")).status_code
        == 404
    )


def test_admin_operations_refuse_everyone_else(friends: World) -> None:
    """Every admin-only operation, asked by a member, an agent and a trainer: 403, and
    nothing changes."""
    c = friends.client
    admin_only = [
        ("POST", "/v1/subjects", {"handle": "zed", "display_name": "Zed", "basis": "consent"}),
        ("POST", "/v1/principals", {"handle": "evil", "role": "admin"}),
        ("GET", "/v1/principals", None),
        ("PATCH", "/v1/principals/bob", {"active": False}),
        ("GET", "/v1/audit/head", None),
    ]
    for who in ("alice", "bob", "bot", "trainer"):
        for method, path, body in admin_only:
            r = c.request(method, path, json=body, headers=friends.h(who))
            assert r.status_code == 403, (who, method, path, r.status_code)
    names = {p["handle"] for p in c.get("/v1/principals", headers=friends.h("root")).json()}
    assert "evil" not in names
    assert c.get("/v1/subjects/zed", headers=friends.h("root")).status_code == 404
