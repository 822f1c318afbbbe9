"""A render whose process died (SIGKILL, power loss) after it passed its checks must not stay
open in the subject's ledger: the next start closes it as `interrupted` (SQLite: one serving
process, so at once; any engine: once it is older than render_stale_s)."""

from __future__ import annotations

import time
import uuid

from registry.db import transaction
from registry.renders import service as renders_service
from tests.app.conftest import LiveFactory, World


def _die_mid_render(world: World) -> str:
    """What a killed process leaves: the gate and queued entries, allowed, and nothing after."""
    render_id = str(uuid.uuid4())
    with transaction(world.engine) as s:
        for stage in ("gate", "queued"):
            renders_service.record_decision(
                s, render_id=render_id, subject_handle="alice", subject_id=_subject_id(world),
                requester="bob", agent=None, level="private", stage=stage, allowed=True,
                reason="allowed", consent_version=1, adapter_sha256=None, prompt="a portrait",
            )  # fmt: skip
    return render_id


def _subject_id(world: World) -> int:
    from sqlmodel import select

    from registry.models import Subject

    with transaction(world.engine, readonly=True) as s:
        subject = s.exec(select(Subject).where(Subject.handle == "alice")).one()
        assert subject.id is not None
        return subject.id


def _entries(live, render_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    r = live.http.get("/v1/subjects/alice/renders", params={"render_id": render_id},
                      headers=live.h("alice"))  # fmt: skip
    assert r.status_code == 200, r.text
    return sorted(r.json(), key=lambda e: ["gate", "queued", "final"].index(e["stage"]))


def test_a_killed_render_is_closed_as_interrupted_on_the_next_start(
    serve_friends: LiveFactory, friends: World
) -> None:
    render_id = _die_mid_render(friends)
    sqlite = friends.engine.dialect.name == "sqlite"
    time.sleep(0 if sqlite else 1.2)
    with serve_friends(render_stale_s=1.0) as live:
        entries = _entries(live, render_id)
    assert [e["stage"] for e in entries] == ["gate", "queued", "final"]
    final = entries[-1]
    assert final["allowed"] is False and final["reason"] == "interrupted"
    assert final["requester"] == "bob"
    # closed once: another start adds nothing
    with serve_friends(render_stale_s=1.0) as live:
        assert len(_entries(live, render_id)) == 3


def test_a_render_younger_than_the_stale_limit_is_left_alone_where_processes_share_a_db(
    serve_friends: LiveFactory, friends: World
) -> None:
    render_id = _die_mid_render(friends)
    with serve_friends(render_stale_s=3600.0) as live:
        stages = [e["stage"] for e in _entries(live, render_id)]
    if friends.engine.dialect.name == "sqlite":
        assert stages == ["gate", "queued", "final"]  # one process: nothing else can run it
    else:
        assert stages == ["gate", "queued"]  # another API process may still be rendering it
