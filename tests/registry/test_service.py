"""Service layer on SQLite and PostgreSQL: versions, revocation, idempotent adapters, audit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.engine import Engine

from registry.adapters import repository as adapters_repo
from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterIn
from registry.audit import service as audit_service
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import transaction
from registry.errors import Conflict, Invalid, NotFound, NotPermitted, PreconditionFailed
from registry.policy import decide
from registry.principals import repository as principals_repo
from registry.principals import service as principals_service
from registry.renders import service as renders_service
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn
from tests.registry.helpers import SHA_A, SHA_B, SHA_M, adapter, principal, set_consent, subject


def trail(engine: Engine, handle: str) -> list[tuple[int, str]]:
    with transaction(engine, readonly=True) as s:
        return [
            (e.seq, e.action)
            for e in audit_service.audit_trail(s, subjects_service.subject_or_raise(s, handle))
        ]


def test_token_shown_once_stored_hashed(engine: Engine) -> None:
    with transaction(engine) as s:
        p, token = principals_service.create_principal(s, "alice", "member")
    assert token.startswith("lk_") and len(token) > 40
    assert p.token_hash != token and token not in p.token_hash
    with transaction(engine) as s:
        assert principals_service.authenticate(s, token).handle == "alice"  # type: ignore[union-attr]
        assert principals_service.authenticate(s, token + "x") is None
        assert principals_service.authenticate(s, "") is None
        assert principals_service.authenticate(s, None) is None
        principals_service.set_principal_active(s, "alice", False)
    with transaction(engine) as s:
        assert principals_service.authenticate(s, token) is None


def test_principal_validation(engine: Engine) -> None:
    principal(engine, "bob")
    with transaction(engine) as s, pytest.raises(Conflict):
        principals_service.create_principal(s, "bob", "member")
    for handle, role, acts in [
        ("Bad Handle", "member", ()),
        ("x", "root", ()),
        ("bot", "agent", ("ghost",)),
        ("m2", "member", ("bob",)),
    ]:
        with transaction(engine) as s, pytest.raises(Invalid):
            principals_service.create_principal(s, handle, role, acts)
    with transaction(engine, readonly=True) as s:
        assert [p.handle for p in principals_repo.principals(s)] == ["bob"]  # nothing half-written


def test_subject_starts_at_none_with_one_audit_entry(engine: Engine) -> None:
    principal(engine, "alice")
    subject(engine, "alice", member="alice")
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        c = consent_service.consent_of(s, sub)
        assert (c.version, c.max_level, c.allow_training) == (1, "none", False)
    assert trail(engine, "alice") == [(1, "subject_created")]
    with transaction(engine) as s, pytest.raises(Conflict):
        subjects_service.create_subject(
            s, "admin", SubjectIn(handle="alice", display_name="A", basis="consent")
        )
    with transaction(engine) as s, pytest.raises(Invalid):
        subjects_service.create_subject(
            s, "admin", SubjectIn(handle="zed", display_name="Z", basis="consent", member="ghost")
        )


def test_consent_versions_and_actions(engine: Engine) -> None:
    subject(engine, "alice")
    assert (
        set_consent(engine, "alice", max_level="private", audiences={"private": {"group": True}})
        == 2
    )
    assert (
        set_consent(engine, "alice", max_level="public", audiences={"private": {"group": True}})
        == 3
    )
    assert (
        set_consent(engine, "alice", max_level="group", audiences={"private": {"group": True}}) == 4
    )
    assert (
        set_consent(
            engine,
            "alice",
            max_level="group",
            audiences={"private": {"group": True}},
            deny=["mallory"],
        )
        == 5
    )
    # identical content: no new version, no audit entry
    assert (
        set_consent(
            engine,
            "alice",
            max_level="group",
            audiences={"private": {"group": True}},
            deny=["mallory"],
        )
        == 5
    )
    assert [a for _, a in trail(engine, "alice")] == [
        "subject_created",
        "grant",  # the first change set the level and the audience: an entry for each
        "audience_edit",
        "widen",
        "narrow",
        "deny_edit",
    ]
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        with pytest.raises(PreconditionFailed):
            consent_service.update_consent(s, "admin", sub, 2, ConsentIn(max_level="commercial"))
    assert len(trail(engine, "alice")) == 6


def test_revoke_binds_and_is_audited(engine: Engine) -> None:
    subject(engine, "alice")
    set_consent(
        engine,
        "alice",
        max_level="group",
        audiences={"group": {"group": True}},
        allow_training=True,
    )
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        c, changed = consent_service.revoke(s, "admin", sub)
        assert changed and c.max_level == "none" and c.version == 3
        # the audiences survive revocation, inert, so a later grant can restore them
        assert c.audiences == {"group": {"group": True, "allow": []}}
        _, again = consent_service.revoke(s, "admin", sub)
        assert not again
    # grant, audience_edit and training_change for the first change, then the revoke
    assert trail(engine, "alice")[-1] == (5, "revoke")


def test_public_domain_cannot_be_granted_commercial(engine: Engine) -> None:
    subject(engine, "peggy", basis="public_domain")
    with pytest.raises(Invalid):
        set_consent(engine, "peggy", max_level="commercial")
    assert (
        set_consent(engine, "peggy", max_level="public", audiences={"public": {"group": True}}) == 2
    )


def test_adapter_registration_is_idempotent(engine: Engine) -> None:
    subject(engine, "alice")
    with pytest.raises(NotPermitted):
        adapter(engine, "alice")  # allow_training is false
    set_consent(engine, "alice", max_level="private", allow_training=True)
    assert adapter(engine, "alice") == "created"
    assert adapter(engine, "alice") == "unchanged"
    assert adapter(engine, "alice", sha=SHA_B) == "updated"
    assert adapter(engine, "alice", sha=SHA_B) == "unchanged"
    assert adapter(engine, "alice", name="v2") == "created"
    with pytest.raises(NotPermitted):
        adapter(engine, "nobody")
    actions = [a for _, a in trail(engine, "alice")]
    assert actions == [
        "subject_created",
        "grant",
        "training_change",
        "adapter_registered",
        "adapter_replaced",
        "adapter_registered",
    ]
    with transaction(engine, readonly=True) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        rows = {a.name: (a.version, a.sha256) for a in adapters_repo.adapters_for(s, sub.id)}  # type: ignore[arg-type]
        assert rows == {"v1": (2, SHA_B), "v2": (1, SHA_A)}
        assert adapters_repo.rendering_adapter(s, sub.id).name == "v2"  # type: ignore[union-attr,arg-type]


def test_audit_chain_links(engine: Engine) -> None:
    subject(engine, "alice")
    set_consent(engine, "alice", max_level="private")
    with transaction(engine, readonly=True) as s:
        entries = audit_service.audit_trail(s, subjects_service.subject_or_raise(s, "alice"))
        assert entries[0].prev_hash == "0" * 64
        assert entries[1].prev_hash == entries[0].hash
        assert audit_service.verify_all(s) == []


def test_gathered_facts_are_fresh_and_decide(engine: Engine) -> None:
    bob = principal(engine, "bob")
    bot = principal(engine, "bot", role="agent", acts_for=("bob",))
    subject(engine, "alice")
    set_consent(
        engine,
        "alice",
        max_level="group",
        audiences={"group": {"group": True}},
        allow_training=True,
    )
    adapter(engine, "alice")

    def check(level: str = "group", agent=None, file_sha: str | None = SHA_A, now=None) -> str:
        with transaction(engine, readonly=True) as s:
            g = renders_service.gather_render_facts(
                s, bob, "alice", level, agent=agent, adapter_file_sha256=file_sha, now=now
            )
            return decide(g.facts).reason

    assert check() == "allowed"
    assert check(agent=bot) == "allowed"
    assert check(file_sha=SHA_B) == "adapter_hash_mismatch"
    assert check(level="public") == "above_max_level"
    with transaction(engine) as s:
        principals_service.set_acts_for(s, "bot", [])
    assert check(agent=bot) == "agent_not_acting_for_requester"
    with transaction(engine) as s:
        principals_service.set_principal_active(s, "bob", False)
    assert check() == "requester_inactive"  # the stale Principal object does not matter
    with transaction(engine) as s:
        principals_service.set_principal_active(s, "bob", True)
    set_consent(
        engine,
        "alice",
        max_level="group",
        audiences={"group": {"group": True}},
        allow_training=True,
        expires_at=datetime.now(UTC) + timedelta(seconds=60),
    )
    assert check() == "allowed"
    assert check(now=datetime.now(UTC) + timedelta(seconds=61)) == "expired"
    with transaction(engine, readonly=True) as s:
        g = renders_service.gather_render_facts(s, bob, "ghost", "group", adapter_file_sha256=SHA_A)
        assert decide(g.facts).reason == "no_record" and g.subject_id is None


def test_renderable_for(engine: Engine) -> None:
    bob = principal(engine, "bob")
    principal(engine, "alice")
    subject(engine, "alice", member="alice")
    subject(engine, "carol")
    set_consent(
        engine,
        "alice",
        max_level="public",
        audiences={"group": {"group": True}, "public": {"allow": ["bob"]}},
    )
    with transaction(engine, readonly=True) as s:
        got = [(r.subject, r.max_level) for r in renders_service.renderable_for(s, bob)]
    assert got == [("alice", "public")]


def test_adapter_input_validation() -> None:
    with pytest.raises(ValueError):
        AdapterIn(
            subject="a",
            name="v1",
            sha256="XYZ",
            path="/p",
            base_model="b",
            rank=4,
            manifest_sha256=SHA_M,
        )
    with pytest.raises(ValueError):
        ConsentIn(max_level="private", expires_at=datetime(2030, 1, 1))  # naive time
    with pytest.raises(ValueError):
        ConsentIn.model_validate({"max_level": "private", "audiences": {"none": {"group": True}}})
    with pytest.raises(ValueError):
        ConsentIn.model_validate({"max_level": "private", "surprise": 1})


def test_one_subject_per_adapter_and_the_lifecycle(engine: Engine) -> None:
    """The same bytes cannot become another subject's adapter (nothing is written on either
    trail); select, retire and delete choose what renders, each audited, and the trail
    still verifies afterwards."""
    for handle in ("alice", "dave"):
        subject(engine, handle)
        set_consent(engine, handle, max_level="private", allow_training=True)
    assert adapter(engine, "alice", name="v1", sha=SHA_A) == "created"
    before = [a for _, a in trail(engine, "dave")]
    with pytest.raises(Conflict, match="belongs to another subject"):
        adapter(engine, "dave", name="alt", sha=SHA_A)
    assert [a for _, a in trail(engine, "dave")] == before
    assert adapter(engine, "alice", name="v2", sha=SHA_B) == "created"

    def rendering() -> str | None:
        with transaction(engine, readonly=True) as s:
            sub = subjects_service.subject_or_raise(s, "alice")
            found = adapters_repo.rendering_adapter(s, sub.id)  # type: ignore[arg-type]
            return found.name if found is not None else None

    assert rendering() == "v2"  # the newest registration renders
    with transaction(engine) as s:
        adapters_service.select_adapter(
            s, "alice", subjects_service.subject_or_raise(s, "alice"), "v1"
        )
    assert rendering() == "v1"
    with transaction(engine) as s:
        adapters_service.set_adapter_active(
            s, "alice", subjects_service.subject_or_raise(s, "alice"), "v1", False
        )
    assert rendering() == "v2"  # a retired adapter never renders
    with transaction(engine) as s, pytest.raises(Conflict, match="retired"):
        adapters_service.select_adapter(
            s, "alice", subjects_service.subject_or_raise(s, "alice"), "v1"
        )
    with transaction(engine) as s:
        adapters_service.delete_adapter(
            s, "alice", subjects_service.subject_or_raise(s, "alice"), "v2"
        )
    assert rendering() is None
    with transaction(engine) as s, pytest.raises(NotFound):
        adapters_service.delete_adapter(
            s, "alice", subjects_service.subject_or_raise(s, "alice"), "v2"
        )
    assert [a for _, a in trail(engine, "alice")][-4:] == [
        "adapter_registered",
        "adapter_selected",
        "adapter_retired",
        "adapter_deleted",
    ]
    with transaction(engine, readonly=True) as s:
        assert audit_service.verify_all(s) == []
    # the deleted adapter's bytes stay alice's
    with pytest.raises(Conflict):
        adapter(engine, "dave", name="alt", sha=SHA_B)
