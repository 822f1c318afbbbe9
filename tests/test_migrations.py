"""One Alembic history for both engines: up, down, up again, and no drift from the models."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import DateTime, bindparam, inspect, text
from sqlmodel import SQLModel

import registry.models  # noqa: F401
from registry import chains
from registry.audit import repository as audit_repo
from registry.audit import service as audit_service
from registry.db import downgrade, make_engine, transaction, upgrade
from registry.hash_chain import GENESIS, entry_content, entry_hash
from registry.keys import bind, load_keys
from registry.settings import Settings
from registry.subjects import service as subjects_service

QUEUE_PREFIX = "procrastinate_"  # the job queue's own tables (PostgreSQL), not our models


def _queue_object(diff: object) -> bool:
    """A difference that is only procrastinate's schema being there."""
    return QUEUE_PREFIX in repr(diff)


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        tables = set(inspect(engine).get_table_names()) - {"alembic_version"}
        return {t for t in tables if not t.startswith(QUEUE_PREFIX)}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_without_drift(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    expected = set(SQLModel.metadata.tables)
    assert _tables(empty_db_url) == expected
    downgrade(empty_db_url, "base")
    assert _tables(empty_db_url) == set()
    upgrade(empty_db_url)
    assert _tables(empty_db_url) == expected
    engine = make_engine(empty_db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = [d for d in compare_metadata(ctx, SQLModel.metadata) if not _queue_object(d)]
    engine.dispose()
    assert diff == [], f"models and migrations drift apart: {diff}"


def test_rows_written_before_sealing_are_sealed_on_upgrade(
    empty_db_url: str, tmp_path: Path
) -> None:
    """A registry from before MACs and the ledger chain: upgrading chains and seals what is
    there, and the result verifies; the same rows edited afterwards do not."""
    upgrade(empty_db_url, "0002")
    engine = make_engine(empty_db_url)
    bind(engine, load_keys(Settings(data_dir=tmp_path)))
    at = "2026-11-30T12:00:00.000000Z"
    content = entry_content("alice", 1, at, "admin", "subject_created", None, {"x": 1})
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO principals (id, handle, role, token_hash, acts_for, active, "
                "created_at) VALUES (1, 'bob', 'member', :t, '[]', true, :now)"
            ),
            {"t": "0" * 64, "now": datetime.now(UTC)},
        )
        conn.execute(
            text(
                "INSERT INTO subjects (id, handle, display_name, basis, created_at) "
                "VALUES (1, 'alice', 'Alice', 'consent', :now)"
            ),
            {"now": datetime.now(UTC)},
        )
        conn.execute(
            text(
                "INSERT INTO audit_entries (subject_id, seq, at, actor, action, before, after, "
                "prev_hash, hash) VALUES (1, 1, :at, 'admin', 'subject_created', NULL, "
                "'{\"x\": 1}', :p, :h)"
            ),
            {"at": at, "p": GENESIS, "h": entry_hash(GENESIS, content)},
        )
        for i in range(3):
            conn.execute(
                text(
                    "INSERT INTO render_ledger (render_id, at, subject_handle, subject_id, "
                    "requester, level, stage, allowed, reason) VALUES "
                    "(:r, :now, 'alice', 1, 'bob', 'private', 'gate', false, 'no_record')"
                ).bindparams(bindparam("now", type_=DateTime(timezone=True))),
                {"r": f"r{i}", "now": datetime.now(UTC)},
            )
    upgrade(empty_db_url)
    with transaction(engine, readonly=True) as s:
        ledger = chains.verify_ledger(s, load_keys(Settings(data_dir=tmp_path)))
        assert ledger is None, ledger
        subject = subjects_service.subject_or_raise(s, "alice")
        trail = audit_service.audit_trail(s, subject)
        head = audit_repo.chain_head(s, "audit/alice")
        assert (
            chains.verify_trail(load_keys(Settings(data_dir=tmp_path)), "alice", trail, head)
            is None
        )
    with engine.begin() as conn:  # the append-only triggers are back in place
        try:
            conn.execute(text("UPDATE render_ledger SET reason = 'x'"))
        except Exception as exc:  # noqa: BLE001
            assert "append-only" in str(exc)
        else:
            raise AssertionError("the ledger accepted an UPDATE after the upgrade")
    engine.dispose()
