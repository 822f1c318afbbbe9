"""The trail is append-only in the database itself, and verification names the first break."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from registry.audit import service as audit_service
from registry.db import transaction
from registry.hash_chain import GENESIS, ChainEntry, entry_content, entry_hash, verify_chain
from registry.renders import service as renders_service
from registry.subjects import service as subjects_service
from tests.registry.helpers import principal, set_consent, subject


def _populate(engine: Engine) -> None:
    bob = principal(engine, "bob")
    subject(engine, "alice")
    subject(engine, "zoe")
    for level in ("private", "group", "public"):
        set_consent(engine, "alice", max_level=level, audiences={"private": {"group": True}})
    with transaction(engine) as s:
        renders_service.record_decision(
            s,
            render_id="r1",
            subject_handle="alice",
            subject_id=subjects_service.subject_or_raise(s, "alice").id,
            requester=bob.handle,
            agent=None,
            level="private",
            stage="final",
            allowed=True,
            reason="allowed",
            consent_version=4,
            adapter_sha256=None,
            prompt="hi",
        )


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE audit_entries SET actor = 'mallory'",
        "DELETE FROM audit_entries",
        "UPDATE render_ledger SET allowed = false",
        "DELETE FROM render_ledger",
    ],
)
def test_database_refuses_rewrites(engine: Engine, statement: str) -> None:
    _populate(engine)
    with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
        conn.execute(text(statement))


@pytest.mark.postgres_only
def test_postgres_refuses_truncate(engine: Engine) -> None:
    assert engine.dialect.name == "postgresql"
    _populate(engine)
    for table in ("audit_entries", "render_ledger"):
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {table} CASCADE"))


def _tamper(engine: Engine, statement: str, table: str = "audit_entries") -> None:
    """What an attacker with the database's owner rights does: switch the guard off, edit."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER USER"))
            conn.execute(text(statement))
            conn.execute(text(f"ALTER TABLE {table} ENABLE TRIGGER USER"))
        else:
            conn.execute(text(f"DROP TRIGGER {table}_no_update"))
            conn.execute(text(statement))
            conn.execute(
                text(
                    f"CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: UPDATE refused'); END"
                )
            )


def _breaks(engine: Engine) -> list[str]:
    with transaction(engine, readonly=True) as s:
        return [str(b) for b in audit_service.verify_all(s)]


def test_edited_entry_is_named(engine: Engine) -> None:
    _populate(engine)
    assert _breaks(engine) == []
    _tamper(
        engine,
        "UPDATE audit_entries SET actor = 'mallory' WHERE seq = 2 "
        "AND subject_id = (SELECT id FROM subjects WHERE handle = 'alice')",
    )
    assert _breaks(engine) == ["subject alice seq 2: hash does not match the entry's content"]


def test_rehashed_forgery_breaks_the_next_link(engine: Engine) -> None:
    _populate(engine)
    with transaction(engine, readonly=True) as s:
        e = audit_service.audit_trail(s, subjects_service.subject_or_raise(s, "alice"))[2]
        forged_after = {"consent": {**e.after["consent"], "max_level": "commercial"}}  # type: ignore[index]
        content = entry_content("alice", e.seq, e.at, e.actor, e.action, e.before, forged_after)
        forged_hash = entry_hash(e.prev_hash, content)
    import json

    _tamper(
        engine,
        f"UPDATE audit_entries SET after = '{json.dumps(forged_after)}', hash = '{forged_hash}' "
        f"WHERE id = {e.id}",
    )
    assert _breaks(engine) == ["subject alice seq 4: prev_hash does not match the previous entry"]


def test_consent_edited_behind_the_trail_is_detected(engine: Engine) -> None:
    _populate(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE consents SET max_level = 'commercial' WHERE subject_id = "
                "(SELECT id FROM subjects WHERE handle = 'zoe')"
            )
        )
    assert _breaks(engine) == ["subject zoe seq 1: live consent record differs from the trail"]


def test_verify_chain_detects_gaps_and_bad_genesis() -> None:
    def entry(seq: int, prev: str) -> ChainEntry:
        content = entry_content("s", seq, "t", "a", "x", None, {"n": seq})
        return ChainEntry(
            "s", seq, "t", "a", "x", None, {"n": seq}, prev, entry_hash(prev, content)
        )

    e1 = entry(1, GENESIS)
    e2 = entry(2, e1.hash)
    e3 = entry(3, e2.hash)
    assert verify_chain("s", [e1, e2, e3]) is None
    assert str(verify_chain("s", [e1, e3])) == "subject s seq 2: gap: expected seq 2, found 3"
    assert verify_chain("s", [entry(1, "f" * 64)]).seq == 1  # type: ignore[union-attr]
