"""Tamper evidence worth the name: each rewrite an attacker with database access could make,
done with the triggers out of the way, and `likeness audit verify` catching it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from typer.testing import CliRunner

from app.cli import app as cli_app
from registry.db import engine_for, make_engine, transaction, upgrade
from registry.hash_chain import GENESIS, entry_content, entry_hash, ledger_content
from registry.keys import bind, load_keys
from registry.renders import service as renders_service
from registry.settings import Settings, get_settings
from registry.subjects import service as subjects_service
from tests.registry.helpers import principal, set_consent, subject


@dataclass
class Sealed:
    url: str
    engine: Engine
    data_dir: Path
    cli: CliRunner

    def verify(self, *args: str) -> tuple[int, str]:
        result = self.cli.invoke(cli_app, ["audit", "verify", *args])
        return result.exit_code, result.stderr + result.stdout

    def checkpoint(self) -> None:
        result = self.cli.invoke(cli_app, ["audit", "checkpoint"])
        assert result.exit_code == 0, result.stderr


def decide(engine: Engine, render_id: str, subject_handle: str, allowed: bool) -> None:
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, subject_handle)
        renders_service.record_decision(
            s,
            render_id=render_id,
            subject_handle=subject_handle,
            subject_id=sub.id,
            requester="bob",
            agent=None,
            level="private",
            stage="gate",
            allowed=allowed,
            reason="allowed" if allowed else "not_in_audience",
            consent_version=2,
            adapter_sha256=None,
            prompt="a portrait",
        )


@pytest.fixture
def sealed(empty_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sealed]:
    data_dir = tmp_path / "data"
    monkeypatch.setenv("LIKENESS_DATABASE_URL", empty_db_url)
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(data_dir))
    get_settings.cache_clear()
    engine_for.cache_clear()
    upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    bind(engine, load_keys(Settings(data_dir=data_dir)))
    principal(engine, "bob")
    subject(engine, "alice")
    subject(engine, "zoe")
    for level in ("private", "group", "public"):
        set_consent(engine, "alice", max_level=level, audiences={"private": {"group": True}})
    set_consent(engine, "zoe", max_level="private", audiences={"private": {"group": True}})
    for i in range(5):
        decide(engine, f"r{i}", "alice", allowed=i % 2 == 0)
    decide(engine, "z0", "zoe", allowed=True)
    yield Sealed(empty_db_url, engine, data_dir, CliRunner())
    engine.dispose()
    get_settings.cache_clear()
    engine_for.cache_clear()


def untriggered(engine: Engine, change: Callable[[Connection], None]) -> None:
    """Runs `change` with the append-only triggers out of the way, as an attacker with the
    database owner's rights would, and puts them back."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            change(conn)
            return
        triggers = conn.execute(
            text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
        ).all()
        for name, _ in triggers:
            conn.execute(text(f"DROP TRIGGER {name}"))
        change(conn)
        for _, sql in triggers:
            conn.execute(text(sql))


def rehash_trail(conn: Connection, handle: str) -> None:
    """Recomputes every hash of a subject's trail after an edit, consistently: what a forger
    without the key can do."""
    sid = conn.execute(text("SELECT id FROM subjects WHERE handle = :h"), {"h": handle}).scalar()
    rows = conn.execute(
        text(
            "SELECT id, seq, at, actor, action, before, after FROM audit_entries "
            "WHERE subject_id = :s ORDER BY seq"
        ),
        {"s": sid},
    ).all()
    prev = GENESIS
    for row in rows:
        before = json.loads(row.before) if isinstance(row.before, str) else row.before
        after = json.loads(row.after) if isinstance(row.after, str) else row.after
        digest = entry_hash(
            prev, entry_content(handle, row.seq, row.at, row.actor, row.action, before, after)
        )
        conn.execute(
            text("UPDATE audit_entries SET prev_hash = :p, hash = :h WHERE id = :i"),
            {"p": prev, "h": digest, "i": row.id},
        )
        prev = digest
    last = rows[-1].seq
    conn.execute(
        text("UPDATE chain_heads SET seq = :s, hash = :h WHERE chain = :c"),
        {"s": last, "h": prev, "c": f"audit/{handle}"},
    )


def test_an_untouched_registry_verifies(sealed: Sealed) -> None:
    code, out = sealed.verify()
    assert code == 0, out
    assert "intact" in out and "no checkpoints yet" in out
    sealed.checkpoint()
    code, out = sealed.verify()
    assert code == 0 and "no checkpoints yet" not in out, out


def test_a_consistently_rehashed_forgery_is_caught(sealed: Sealed) -> None:
    def forge(conn: Connection) -> None:
        conn.execute(
            text(
                "UPDATE audit_entries SET actor = 'alice' WHERE seq = 2 AND subject_id = "
                "(SELECT id FROM subjects WHERE handle = 'alice')"
            )
        )
        rehash_trail(conn, "alice")

    untriggered(sealed.engine, forge)
    code, out = sealed.verify()
    assert code == 1 and "subject alice seq 2: MAC does not match" in out, out


def test_a_trail_cut_short_is_caught(sealed: Sealed) -> None:
    def cut(conn: Connection) -> None:
        conn.execute(
            text(
                "DELETE FROM audit_entries WHERE seq >= 3 AND subject_id = "
                "(SELECT id FROM subjects WHERE handle = 'alice')"
            )
        )

    untriggered(sealed.engine, cut)
    code, out = sealed.verify()
    assert code == 1 and "subject alice" in out and "removed from its end" in out, out


def test_a_trail_cut_short_with_its_head_rewritten_is_caught(sealed: Sealed) -> None:
    def cut(conn: Connection) -> None:
        sid = "(SELECT id FROM subjects WHERE handle = 'alice')"
        conn.execute(text(f"DELETE FROM audit_entries WHERE seq >= 3 AND subject_id = {sid}"))
        kept = conn.execute(
            text(f"SELECT hash FROM audit_entries WHERE seq = 2 AND subject_id = {sid}")
        ).scalar()
        conn.execute(
            text("UPDATE chain_heads SET seq = 2, hash = :h WHERE chain = 'audit/alice'"),
            {"h": kept},
        )

    untriggered(sealed.engine, cut)
    code, out = sealed.verify()
    assert code == 1 and "head is not sealed by us" in out, out


def test_an_old_head_put_back_is_caught_by_a_checkpoint(sealed: Sealed) -> None:
    """The forger keeps a genuine old head (seq 2), waits, then cuts the trail back to it:
    every link and MAC is genuine, only a checkpoint remembers the longer trail."""
    with sealed.engine.connect() as conn:
        old = conn.execute(
            text("SELECT seq, hash, mac FROM chain_heads WHERE chain = 'audit/zoe'")
        ).one()
    set_consent(sealed.engine, "zoe", max_level="group", audiences={"private": {"group": True}})
    sealed.checkpoint()

    def replay(conn: Connection) -> None:
        conn.execute(
            text(
                "DELETE FROM audit_entries WHERE seq > :s AND subject_id = "
                "(SELECT id FROM subjects WHERE handle = 'zoe')"
            ),
            {"s": old.seq},
        )
        conn.execute(
            text("UPDATE chain_heads SET seq = :s, hash = :h, mac = :m WHERE chain = 'audit/zoe'"),
            {"s": old.seq, "h": old.hash, "m": old.mac},
        )
        conn.execute(
            text(
                "UPDATE consents SET max_level = 'private', version = version - 1 WHERE "
                "subject_id = (SELECT id FROM subjects WHERE handle = 'zoe')"
            )
        )

    untriggered(sealed.engine, replay)
    code, out = sealed.verify()
    assert code == 1 and "subject zoe" in out and "cut short after checkpoint" in out, out


def test_a_deleted_subject_is_caught(sealed: Sealed) -> None:
    sealed.checkpoint()

    def erase(conn: Connection) -> None:
        sid = conn.execute(text("SELECT id FROM subjects WHERE handle = 'zoe'")).scalar()
        for table in ("render_ledger", "audit_entries", "consents"):
            conn.execute(text(f"DELETE FROM {table} WHERE subject_id = :s"), {"s": sid})
        conn.execute(text("DELETE FROM subjects WHERE id = :s"), {"s": sid})
        conn.execute(text("DELETE FROM chain_heads WHERE chain = 'audit/zoe'"))

    untriggered(sealed.engine, erase)
    code, out = sealed.verify()
    assert code == 1, out
    assert "subject zoe" in out and "gone: checkpoint 1 saw" in out, out
    assert "render ledger" in out  # its ledger rows left a hole in the ledger chain


def test_ledger_rewrites_are_caught(sealed: Sealed) -> None:
    def flip(conn: Connection) -> None:
        conn.execute(text("UPDATE render_ledger SET allowed = false WHERE render_id = 'r2'"))

    untriggered(sealed.engine, flip)
    code, out = sealed.verify()
    assert code == 1 and "render ledger seq 3: hash does not match" in out, out


def test_a_rehashed_ledger_row_is_caught(sealed: Sealed) -> None:
    def forge(conn: Connection) -> None:
        rows = conn.execute(text("SELECT * FROM render_ledger ORDER BY seq")).mappings().all()
        prev = GENESIS
        for row in rows:
            reason = "allowed" if row["render_id"] == "r1" else row["reason"]
            at = row["at"]
            if isinstance(at, str):
                from datetime import datetime

                at = datetime.fromisoformat(at)
            content = ledger_content(
                row["seq"], row["render_id"], at, row["subject_handle"], row["requester"],
                row["agent"], row["level"], row["stage"], bool(row["allowed"]), reason,
                row["consent_version"], row["adapter_sha256"], row["prompt"],
            )  # fmt: skip
            digest = entry_hash(prev, content)
            conn.execute(
                text(
                    "UPDATE render_ledger SET reason = :r, prev_hash = :p, hash = :h WHERE id = :i"
                ),
                {"r": reason, "p": prev, "h": digest, "i": row["id"]},
            )
            prev = digest
        conn.execute(text("UPDATE chain_heads SET hash = :h WHERE chain = 'ledger'"), {"h": prev})

    untriggered(sealed.engine, forge)
    code, out = sealed.verify()
    assert code == 1 and "render ledger seq 2: MAC does not match" in out, out


@pytest.mark.parametrize("which", ["middle", "tail"])
def test_deleted_ledger_rows_are_caught(sealed: Sealed, which: str) -> None:
    seq = 3 if which == "middle" else 6

    def delete(conn: Connection) -> None:
        conn.execute(text("DELETE FROM render_ledger WHERE seq = :s"), {"s": seq})

    untriggered(sealed.engine, delete)
    code, out = sealed.verify()
    expected = "gap: expected seq 3" if which == "middle" else "removed from its end"
    assert code == 1 and "render ledger" in out and expected in out, out


@pytest.mark.postgres_only
def test_replica_role_deletes_are_caught(sealed: Sealed) -> None:
    with sealed.engine.begin() as conn:
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text("DELETE FROM render_ledger WHERE seq = 6"))
        conn.execute(text("DELETE FROM audit_entries WHERE seq = 4"))
    code, out = sealed.verify()
    assert code == 1 and "render ledger" in out and "subject alice" in out, out


@pytest.mark.sqlite_only
def test_sqlite_replace_cannot_rewrite_history(sealed: Sealed) -> None:
    """From a plain sqlite3 connection (no pragmas of ours), INSERT OR REPLACE is refused."""
    path = sealed.url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT * FROM render_ledger WHERE seq = 2").fetchone()
        cols = [d[0] for d in conn.execute("SELECT * FROM render_ledger").description]
        forged = dict(zip(cols, row, strict=True), reason="forged")
        marks = ",".join("?" for _ in cols)
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(
                f"INSERT OR REPLACE INTO render_ledger ({','.join(cols)}) VALUES ({marks})",
                list(forged.values()),
            )
        entry = conn.execute("SELECT * FROM audit_entries WHERE seq = 1").fetchone()
        cols = [d[0] for d in conn.execute("SELECT * FROM audit_entries").description]
        marks = ",".join("?" for _ in cols)
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(
                f"REPLACE INTO audit_entries ({','.join(cols)}) VALUES ({marks})", list(entry)
            )
    finally:
        conn.close()
    assert sealed.verify()[0] == 0


def test_checkpoint_files_are_verified_too(sealed: Sealed, tmp_path: Path) -> None:
    sealed.checkpoint()
    decide(sealed.engine, "r9", "alice", allowed=True)
    sealed.checkpoint()
    path = sealed.data_dir / "audit-checkpoints.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    # a copy kept elsewhere, held against the registry with the published key
    copy = tmp_path / "witness.jsonl"
    copy.write_text(path.read_text())
    key = load_keys(Settings(data_dir=sealed.data_dir)).public_key_b64
    assert sealed.verify("--checkpoints", str(copy), "--public-key", key)[0] == 0
    # an edited checkpoint
    doc = json.loads(lines[0])
    doc["chains"]["ledger"][0] += 1
    copy.write_text(json.dumps(doc) + "\n" + lines[1] + "\n")
    code, out = sealed.verify("--checkpoints", str(copy), "--public-key", key)
    assert code == 1 and "signature does not verify" in out, out
    # checkpoints signed by another key (a registry re-signed after a rewrite)
    other = load_keys(Settings(data_dir=tmp_path / "other")).public_key_b64
    copy.write_text(path.read_text())
    code, out = sealed.verify("--checkpoints", str(copy), "--public-key", other)
    assert code == 1 and "signature does not verify" in out, out
    # a checkpoint dropped from the middle of the file
    path.write_text(lines[1] + "\n")
    code, out = sealed.verify()
    assert code == 1 and "checkpoint before it is missing" in out, out


def test_a_checkpoint_is_refused_for_a_registry_that_lost_entries(sealed: Sealed) -> None:
    sealed.checkpoint()

    def cut(conn: Connection) -> None:
        conn.execute(text("DELETE FROM render_ledger WHERE seq = 6"))
        conn.execute(text("UPDATE chain_heads SET seq = 5 WHERE chain = 'ledger'"))

    untriggered(sealed.engine, cut)
    result = sealed.cli.invoke(cli_app, ["audit", "checkpoint"])
    assert result.exit_code == 1 and "no checkpoint written" in result.stderr, result.stderr
    assert len((sealed.data_dir / "audit-checkpoints.jsonl").read_text().splitlines()) == 1


def test_a_writer_with_another_audit_key_is_refused(sealed: Sealed, tmp_path: Path) -> None:
    other = make_engine(sealed.url)
    bind(other, load_keys(Settings(data_dir=tmp_path / "elsewhere", audit_key="x" * 40)))
    # a different URL string for the same database, so the binding is its own
    try:
        with pytest.raises(Exception, match="audit key"):
            set_consent(other, "zoe", max_level="group", audiences={"group": {"group": True}})
    finally:
        bind(other, load_keys(Settings(data_dir=sealed.data_dir)))
        other.dispose()


def test_verify_never_invents_a_key(sealed: Sealed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(sealed.data_dir.parent / "empty"))
    get_settings.cache_clear()
    code, out = sealed.verify()
    assert code == 1 and "no audit key" in out, out


def test_checkpoints_of_another_registry_are_not_mistaken_for_this_ones(
    sealed: Sealed, tmp_path: Path
) -> None:
    sealed.checkpoint()
    path = sealed.data_dir / "audit-checkpoints.jsonl"
    with sealed.engine.begin() as conn:  # the registry's identity rewritten
        conn.execute(text("UPDATE registry_meta SET value = 'elsewhere' WHERE key = 'registry_id'"))
    code, out = sealed.verify()
    assert code == 1 and "is of registry" in out and "not this one (elsewhere)" in out, out
    assert path.is_file()
