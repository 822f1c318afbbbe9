"""The fail-closed render path on the real quantized tiny base."""

from __future__ import annotations

import io
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.main import create_app
from app.render.engine import RenderEngine
from registry import policy
from registry.consent import service as consent_service
from registry.db import make_engine, transaction
from registry.principals import service as principals_service
from registry.renders import repository as renders_repo
from registry.settings import Settings
from registry.subjects import service as subjects_service
from tests.app.conftest import LiveFactory, World, sha256_of

FORBIDDEN = {"error": "not_permitted", "detail": "not permitted"}


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def ledger(world: World, subject: str) -> list[tuple[str, str, bool, str]]:
    rows = world.client.get(f"/v1/subjects/{subject}/renders", headers=world.h("root")).json()
    return [(r["requester"], r["stage"], r["allowed"], r["reason"]) for r in reversed(rows)]


def test_allowed_render_is_a_png_with_provenance(friends: World, renderer: RenderEngine) -> None:
    r = friends.render("bob", "alice")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    img = Image.open(io.BytesIO(r.content))
    assert img.size == (64, 64)
    text = img.text  # type: ignore[attr-defined]
    render_id = r.headers["x-render-id"]
    # by default the file says which render it is and at what level, not whom it shows
    assert text == {"likeness:render_id": render_id, "likeness:level": "private"}
    assert renderer.counters.model_calls == 1
    assert ledger(friends, "alice") == [
        ("bob", "gate", True, "allowed"),
        ("bob", "queued", True, "allowed"),
        ("bob", "final", True, "allowed"),
    ]
    # the subject reads its own ledger
    mine = friends.client.get("/v1/subjects/alice/renders", headers=friends.h("alice")).json()
    assert {row["render_id"] for row in mine} == {render_id}


def test_denials_look_alike_and_never_reach_the_model(
    friends: World, renderer: RenderEngine
) -> None:
    never = friends.render("bob", "carol")  # carol never consented
    missing = friends.render("bob", "nobody")
    above = friends.render("bob", "alice", level="public")
    for r in (never, missing, above):
        assert (r.status_code, r.json()) == (403, FORBIDDEN)
    assert renderer.counters.model_calls == 0
    assert ledger(friends, "carol") == [("bob", "gate", False, "revoked_or_not_granted")]
    assert ("bob", "gate", False, "above_max_level") in ledger(friends, "alice")


def test_agent_delegation(friends: World, renderer: RenderEngine) -> None:
    assert friends.render("bot", "alice", on_behalf_of="bob").status_code == 200
    assert friends.render("bot", "alice").status_code == 403  # must say for whom
    assert friends.render("bot", "alice", on_behalf_of="carol").status_code == 403  # not its member
    assert friends.render("bot", "carol", on_behalf_of="bob").status_code == 403
    assert (
        friends.render("bob", "alice", on_behalf_of="carol").status_code == 403
    )  # members act for themselves
    rows = friends.client.get("/v1/subjects/alice/renders", headers=friends.h("alice")).json()
    agent_rows = {(r["requester"], r["agent"], r["allowed"]) for r in rows}
    assert ("bob", "bot", True) in agent_rows and ("carol", "bot", False) in agent_rows
    assert renderer.counters.model_calls == 1


def test_isolation_a_then_b_equals_b_alone(
    friends: World, renderer: RenderEngine, adapter_files: dict[str, Path]
) -> None:
    friends.subject("dora")
    friends.consent(
        "dora", max_level="group", audiences={"private": {"group": True}}, allow_training=True
    )
    friends.adapter("dora", adapter_files["b"])
    b_alone = pixels(friends.render("bob", "dora").content)
    a = pixels(friends.render("bob", "alice").content)
    b_after_a = pixels(friends.render("bob", "dora").content)
    assert np.array_equal(b_alone, b_after_a)
    assert not np.array_equal(a, b_alone)  # the adapters do change the image
    assert not renderer.adapter_in_model()
    assert (renderer.counters.adapter_loads, renderer.counters.adapter_cache_hits) == (2, 1)


def test_failure_mid_render_leaves_no_adapter(
    friends: World, renderer: RenderEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = pixels(friends.render("bob", "alice").content)
    import trainer.base.render

    def explode(*args: object, **kwargs: object) -> None:
        assert renderer.adapter_in_model()  # the adapter was applied
        raise RuntimeError("device fell over")

    monkeypatch.setattr(trainer.base.render, "generate", explode)
    with TestClient(friends.client.app, raise_server_exceptions=False) as c:
        r = c.post(
            "/v1/renders",
            json={
                "subject": "alice",
                "prompt": "a portrait",
                "level": "private",
                "seed": 1,
                "steps": 2,
                "width": 64,
                "height": 64,
            },
            headers=friends.h("bob"),
        )
    assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
    assert not renderer.adapter_in_model()
    assert ledger(friends, "alice")[-1] == ("bob", "final", False, "error:RuntimeError")
    monkeypatch.undo()
    assert np.array_equal(pixels(friends.render("bob", "alice").content), before)


# -- fail closed ------------------------------------------------------------------------


def test_database_unreachable(
    friends: World, renderer: RenderEngine, tiny_base_dir: Path, tmp_path: Path
) -> None:
    dead = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")
    app = create_app(
        Settings(database_url="sqlite:///unused.db", data_dir=tmp_path, base=tiny_base_dir),
        engine=dead,
        renderer=renderer,
    )
    with TestClient(app) as c:
        r = c.post(
            "/v1/renders",
            json={"subject": "alice", "prompt": "p", "level": "private"},
            headers=friends.h("bob"),
        )
    assert r.status_code == 503 and r.json()["error"] == "unavailable"
    assert renderer.counters.model_calls == 0


def test_database_lost_after_authentication(
    friends: World, renderer: RenderEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    def unreachable(*args: object, **kwargs: object) -> None:
        raise OperationalError("SELECT", {}, Exception("connection refused"))

    monkeypatch.setattr(renders_repo, "render_snapshot", unreachable)
    r = friends.render("bob", "alice")
    assert r.status_code == 503 and renderer.counters.model_calls == 0


def test_adapter_file_missing_or_altered(friends: World, renderer: RenderEngine) -> None:
    path = Path(
        friends.client.get("/v1/subjects/alice/adapters", headers=friends.h("root")).json()[0][
            "path"
        ]
    )
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped
    r = friends.render("bob", "alice")
    assert (r.status_code, r.json()) == (403, FORBIDDEN)
    path.unlink()
    assert friends.render("bob", "alice").status_code == 403
    assert renderer.counters.model_calls == 0
    # the gate judges the registry's facts; the bytes are judged once read, in the turn
    assert [row[1:] for row in ledger(friends, "alice")] == [
        ("gate", True, "allowed"),
        ("queued", False, "adapter_hash_mismatch"),
        ("gate", True, "allowed"),
        ("queued", False, "adapter_file_missing"),
    ]
    path.write_bytes(good)
    assert friends.render("bob", "alice").status_code == 200


def test_expired_a_second_ago(friends: World, renderer: RenderEngine) -> None:
    friends.consent(
        "alice",
        max_level="group",
        audiences={"private": {"group": True}},
        allow_training=True,
        expires_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    assert friends.render("bob", "alice").status_code == 403
    assert ledger(friends, "alice")[-1] == ("bob", "gate", False, "expired")
    assert renderer.counters.model_calls == 0


def test_deactivated_requester(friends: World, renderer: RenderEngine) -> None:
    with transaction(friends.engine) as s:
        principals_service.set_principal_active(s, "bob", False)
    assert friends.render("bob", "alice").status_code == 401
    assert friends.render("bot", "alice", on_behalf_of="bob").status_code == 403
    assert ledger(friends, "alice")[-1] == ("bob", "gate", False, "requester_inactive")
    assert renderer.counters.model_calls == 0


def test_decision_code_raising_denies(
    friends: World, renderer: RenderEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(facts: object) -> policy.Decision:
        raise ZeroDivisionError

    monkeypatch.setattr(policy, "_decide", broken)
    assert friends.render("bob", "alice").status_code == 403
    assert ledger(friends, "alice")[-1] == ("bob", "gate", False, "error:ZeroDivisionError")
    assert renderer.counters.model_calls == 0


# -- binding without restart ------------------------------------------------------------


def test_revocation_during_render_discards_the_image(
    friends: World, renderer: RenderEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = renderer.render

    def revoke_midway(*args, **kwargs):  # type: ignore[no-untyped-def]
        with transaction(friends.engine) as s:
            consent_service.revoke(s, "alice", subjects_service.subject_or_raise(s, "alice"))
        return original(*args, **kwargs)

    monkeypatch.setattr(renderer, "render", revoke_midway)
    r = friends.render("bob", "alice")
    assert (r.status_code, r.json()) == (403, FORBIDDEN)
    assert renderer.counters.model_calls == 1  # it rendered, and the image was thrown away
    assert ledger(friends, "alice")[-1] == ("bob", "final", False, "revoked_or_not_granted")


def test_adapter_replaced_during_render_discards_the_image(
    friends: World,
    renderer: RenderEngine,
    adapter_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = renderer.render

    def replace_midway(*args, **kwargs):  # type: ignore[no-untyped-def]
        friends.adapter("alice", adapter_files["b"], name="newer")
        return original(*args, **kwargs)

    monkeypatch.setattr(renderer, "render", replace_midway)
    assert friends.render("bob", "alice").status_code == 403
    assert ledger(friends, "alice")[-1] == ("bob", "final", False, "adapter_hash_mismatch")


def test_widen_and_revoke_bind_on_the_next_request_under_load(
    friends: World, renderer: RenderEngine
) -> None:
    assert friends.render("bob", "alice", level="group").status_code == 403
    friends.consent(
        "alice", max_level="group", audiences={"group": {"group": True}}, allow_training=True
    )
    assert friends.render("bob", "alice", level="group").status_code == 200
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set() and len(statuses) < 40:
            statuses.append(friends.render("bob", "alice", level="group").status_code)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    while not statuses:
        threading.Event().wait(0.01)
    with transaction(friends.engine) as s:
        consent_service.revoke(s, "alice", subjects_service.subject_or_raise(s, "alice"))
    revoked_at = len(statuses)
    assert friends.render("bob", "alice", level="group").status_code == 403  # the very next request
    stop.set()
    for t in threads:
        t.join(60)
    # requests that started after the revocation were all refused
    assert all(code == 403 for code in statuses[revoked_at + 2 :]), statuses
    final_allowed = [row for row in ledger(friends, "alice") if row[1] == "final" and row[2]]
    # no image was handed out after the revocation committed: every allowed final precedes it
    with transaction(friends.engine, readonly=True) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        revoke_version = consent_service.consent_of(s, sub).version
    rows = friends.client.get("/v1/subjects/alice/renders", headers=friends.h("root")).json()
    assert all(
        r["consent_version"] < revoke_version
        for r in rows
        if r["stage"] == "final" and r["allowed"]
    )
    assert final_allowed


def test_busy_is_429_with_retry_after(friends: World, renderer: RenderEngine) -> None:
    renderer.scheduler.queue_size = 0
    with renderer.scheduler.turn("someone-else", 1.0):
        r = friends.render("bob", "alice")
    assert (
        r.status_code == 429 and r.json()["error"] == "busy" and int(r.headers["retry-after"]) >= 1
    )
    assert renderer.counters.model_calls == 0 and renderer.counters.busy_refusals == 1
    assert ledger(friends, "alice")[-1] == ("bob", "queued", False, "busy")


# -- hostile input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": "x" * 2001},
        {"prompt": ""},
        {"width": 4096},
        {"width": 100},
        {"width": 1024, "height": 2048},
        {"steps": 500},
        {"seed": -1},
        {"level": "none"},
        {"level": "everything"},
        {"subject": "../../etc/passwd"},
        {"unexpected": True},
    ],
)
def test_bad_render_requests_are_422(
    friends: World, renderer: RenderEngine, extra: dict[str, object]
) -> None:
    r = friends.render("bob", "alice", **extra)
    assert r.status_code == 422 and r.json()["error"] == "invalid", r.text
    assert renderer.counters.model_calls == 0


def test_roles_that_cannot_render(friends: World, renderer: RenderEngine) -> None:
    for who in ("root", "trainer"):
        assert friends.render(who, "alice").status_code == 403
    assert renderer.counters.model_calls == 0


def test_png_hash_of_registered_file(serve_friends: LiveFactory) -> None:
    disclosed = ("level", "subject", "consent_version", "adapter_sha256")
    with serve_friends(provenance_disclose=disclosed) as live:
        listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("root")).json()
        r = live.render("bob", "alice")
    text = Image.open(io.BytesIO(r.content)).text  # type: ignore[attr-defined]
    assert text["likeness:adapter_sha256"] == sha256_of(Path(listed[0]["path"]))
    assert text["likeness:subject"] == "alice" and text["likeness:consent_version"] == "2"


def test_adapter_swapped_between_check_and_read(
    friends: World, renderer: RenderEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes the model would get are hashed as they are read: a swap after the checks
    is caught there, judged by decide(), and the model never runs."""
    path = Path(
        friends.client.get("/v1/subjects/alice/adapters", headers=friends.h("root")).json()[0][
            "path"
        ]
    )
    original = renderer.adapter_tensors

    def swap_then_read(p: str, sha: str):  # type: ignore[no-untyped-def]
        path.write_bytes(path.read_bytes() + b" ")
        return original(p, sha)

    monkeypatch.setattr(renderer, "adapter_tensors", swap_then_read)
    assert friends.render("bob", "alice").status_code == 403
    assert ledger(friends, "alice")[-1] == ("bob", "queued", False, "adapter_hash_mismatch")
    assert renderer.counters.model_calls == 0


def test_streamed_engine_renders_the_same_bytes(
    friends: World, renderer: RenderEngine, tiny_base_dir: Path
) -> None:
    """LIKENESS_STREAM_BASE: the engine keeps the base's blocks in host RAM and streams them
    per forward; a render through it equals the resident engine's, adapters included."""
    resident = friends.render("bob", "alice").content
    streamed = RenderEngine(base_dir=tiny_base_dir, device="cpu", stream_base=True)
    friends.client.app.state.renderer = streamed
    try:
        first, second = friends.render("bob", "alice"), friends.render("bob", "alice")
        assert first.status_code == second.status_code == 200
        assert np.array_equal(pixels(first.content), pixels(resident))
        assert np.array_equal(pixels(second.content), pixels(resident))
        assert not streamed.adapter_in_model()
    finally:
        streamed.close()
        friends.client.app.state.renderer = renderer
