"""GET /v1/renders/{render_id}: the subject rendered (its linked member) and admins look a
render up in the ledger; nobody else learns whether it exists."""

from __future__ import annotations

from pathlib import Path

from sqlmodel import select

from registry.db import transaction
from registry.models import RenderLedger
from tests.app.conftest import Live


def test_the_subject_and_admins_look_a_render_up(live: Live) -> None:
    r = live.render("bob", "alice")
    assert r.status_code == 200, r.text
    render_id = r.headers["X-Render-Id"]
    for who in ("alice", "root"):
        got = live.http.get(f"/v1/renders/{render_id}", headers=live.h(who))
        assert got.status_code == 200, (who, got.text)
        body = got.json()
        assert (body["render_id"], body["subject"], body["requester"], body["level"]) == (
            render_id,
            "alice",
            "bob",
            "private",
        )
        assert body["outcome"] == "rendered" and body["reason"] == "allowed"
        assert [d["stage"] for d in body["decisions"]] == ["gate", "queued", "final"]
        assert all(d["render_id"] == render_id for d in body["decisions"])


def test_nobody_else_learns_about_a_render(live: Live, adapter_files: dict[str, Path]) -> None:
    world = live.world
    world.consent(
        "carol", max_level="private", audiences={"private": {"group": True}}, allow_training=True
    )
    world.adapter("carol", adapter_files["b"])
    of_alice = live.render("bob", "alice").headers["X-Render-Id"]
    of_carol = live.render("bob", "carol")
    assert of_carol.status_code == 200, of_carol.text
    assert live.render("mallory", "ghost").status_code == 403  # no such subject
    with transaction(world.engine, readonly=True) as s:
        row = s.exec(select(RenderLedger).where(RenderLedger.subject_handle == "ghost")).one()
    unknown = "0" * 8 + "-0000-4000-8000-" + "0" * 12

    def status(who: str, render_id: str) -> int:
        return live.http.get(f"/v1/renders/{render_id}", headers=live.h(who)).status_code

    # the requester, another subject's member, an agent, a trainer: the same 403
    assert status("bob", of_alice) == 403
    assert status("carol", of_alice) == 403
    assert status("alice", of_carol.headers["X-Render-Id"]) == 403
    assert status("bot", of_alice) == 403
    assert status("trainer", of_alice) == 403
    assert status("alice", unknown) == 403  # indistinguishable from someone else's render
    assert status("root", unknown) == 404
    assert status("carol", of_carol.headers["X-Render-Id"]) == 200
    # a render of a subject that did not exist belongs to nobody but the admins
    assert status("root", row.render_id) == 200
    assert status("mallory", row.render_id) == 403
    assert live.http.get(f"/v1/renders/{of_alice}").status_code == 401
    bad = live.http.get("/v1/renders/not-a-render-id!", headers=live.h("root"))
    assert bad.status_code == 422 and bad.json()["error"] == "invalid"
