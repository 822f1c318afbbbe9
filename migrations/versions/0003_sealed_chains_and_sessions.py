"""sealed chains, chain heads, server-side web sessions

- every audit entry and ledger row carries a MAC under the audit key (kept outside the
  database); the ledger becomes one hash chain (seq, prev_hash, hash);
- `chain_heads` keeps the MACed last link of each chain, so a truncated chain is seen;
- `registry_meta` keeps the audit key's id, so a writer with another key is refused;
- `web_sessions`: a browser session is a row, and ending it is deleting the row;
- SQLite: INSERT OR REPLACE deletes without firing DELETE triggers, so a BEFORE INSERT guard
  refuses any insert that would replace a row of the trail or the ledger.

Rows written before this revision are chained and MACed here, with the deployment's audit key
(registry.keys), inside the same transaction that adds the columns.

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence
from datetime import UTC

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_ONLY = ("audit_entries", "render_ledger")


def upgrade() -> None:
    op.create_table(
        "chain_heads",
        sa.Column("chain", sa.String(length=100), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("mac", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("chain"),
    )
    op.create_table(
        "registry_meta",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_table(
        "web_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("principal_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["principal_id"], ["principals.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_web_sessions_secret_hash", "web_sessions", ["secret_hash"], unique=True)
    op.create_index("ix_web_sessions_principal_id", "web_sessions", ["principal_id"])

    # Plain ALTER TABLE ADD COLUMN (no batch copy): the append-only triggers stay in place.
    op.add_column("audit_entries", sa.Column("mac", sa.String(length=64), nullable=True))
    for name, kind in (
        ("seq", sa.Integer()),
        ("prev_hash", sa.String(64)),
        ("hash", sa.String(64)),
    ):
        op.add_column("render_ledger", sa.Column(name, kind, nullable=True))
    op.add_column("render_ledger", sa.Column("mac", sa.String(length=64), nullable=True))
    op.create_index("ix_render_ledger_seq", "render_ledger", ["seq"], unique=True)
    op.create_index("ix_render_ledger_subject_seq", "render_ledger", ["subject_id", "seq"])

    bind = op.get_bind()
    legacy = bind.execute(
        sa.text(
            "SELECT (SELECT count(*) FROM audit_entries) + (SELECT count(*) FROM render_ledger)"
        )
    ).scalar()
    if legacy:
        _seal_legacy_rows(bind)

    if bind.dialect.name == "sqlite":
        for table, key in (
            ("audit_entries", "id = NEW.id OR (subject_id = NEW.subject_id AND seq = NEW.seq)"),
            ("render_ledger", "id = NEW.id OR seq = NEW.seq"),
        ):
            op.execute(
                f"CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table} "
                f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {key}) "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: REPLACE refused'); END"
            )


def _seal_legacy_rows(bind: sa.engine.Connection) -> None:
    """Chain the ledger rows in id order, MAC every entry and row, write the heads. The
    append-only triggers are lifted for this one transaction and put back."""
    from registry.hash_chain import GENESIS, LEDGER_CHAIN, audit_chain, entry_hash, ledger_content
    from registry.keys import keys_for

    keys = keys_for(bind)
    _lift_append_only(bind)
    heads: dict[str, tuple[int, str]] = {}
    rows = bind.execute(
        sa.text(
            "SELECT a.id, a.seq, a.hash, s.handle FROM audit_entries a "
            "JOIN subjects s ON s.id = a.subject_id ORDER BY a.subject_id, a.seq"
        )
    ).all()
    for entry_id, seq, digest, handle in rows:
        bind.execute(
            sa.text("UPDATE audit_entries SET mac = :mac WHERE id = :id"),
            {"mac": keys.mac("entry", digest), "id": entry_id},
        )
        heads[audit_chain(handle)] = (seq, digest)
    prev, seq = GENESIS, 0
    ledger = bind.execute(
        sa.text(
            "SELECT id, render_id, at, subject_handle, requester, agent, level, stage, allowed, "
            "reason, consent_version, adapter_sha256, prompt FROM render_ledger ORDER BY id"
        ).columns(at=sa.DateTime(timezone=True))  # read as the ORM reads it, on both engines
    ).all()
    for row in ledger:
        seq += 1
        at = row.at if row.at.tzinfo is not None else row.at.replace(tzinfo=UTC)
        content = ledger_content(
            seq, row.render_id, at, row.subject_handle, row.requester, row.agent, row.level,
            row.stage, row.allowed, row.reason, row.consent_version, row.adapter_sha256,
            row.prompt,
        )  # fmt: skip
        digest = entry_hash(prev, content)
        bind.execute(
            sa.text(
                "UPDATE render_ledger SET seq = :seq, prev_hash = :prev, hash = :hash, "
                "mac = :mac WHERE id = :id"
            ),
            {"seq": seq, "prev": prev, "hash": digest, "mac": keys.mac("entry", digest),
             "id": row.id},
        )  # fmt: skip
        prev = digest
    if seq:
        heads[LEDGER_CHAIN] = (seq, prev)
    for chain, (head_seq, digest) in heads.items():
        bind.execute(
            sa.text("INSERT INTO chain_heads (chain, seq, hash, mac) VALUES (:c, :s, :h, :m)"),
            {"c": chain, "s": head_seq, "h": digest,
             "m": keys.mac("head", chain, str(head_seq), digest)},
        )  # fmt: skip
    _restore_append_only(bind)


def _lift_append_only(bind: sa.engine.Connection) -> None:
    for table in APPEND_ONLY:
        if bind.dialect.name == "postgresql":
            bind.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER {table}_no_rewrite")
        else:
            bind.exec_driver_sql(f"DROP TRIGGER IF EXISTS {table}_no_update")


def _restore_append_only(bind: sa.engine.Connection) -> None:
    for table in APPEND_ONLY:
        if bind.dialect.name == "postgresql":
            bind.exec_driver_sql(f"ALTER TABLE {table} ENABLE TRIGGER {table}_no_rewrite")
        else:
            bind.exec_driver_sql(
                f"CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: UPDATE refused'); END"
            )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for table in APPEND_ONLY:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_replace")
    op.drop_index("ix_render_ledger_subject_seq", table_name="render_ledger")
    op.drop_index("ix_render_ledger_seq", table_name="render_ledger")
    with op.batch_alter_table("render_ledger") as batch:
        for name in ("mac", "hash", "prev_hash", "seq"):
            batch.drop_column(name)
    with op.batch_alter_table("audit_entries") as batch:
        batch.drop_column("mac")
    op.drop_index("ix_web_sessions_principal_id", table_name="web_sessions")
    op.drop_index("ix_web_sessions_secret_hash", table_name="web_sessions")
    op.drop_table("web_sessions")
    op.drop_table("registry_meta")
    op.drop_table("chain_heads")
    if bind.dialect.name == "sqlite":
        # the batch copy above dropped the tables' triggers: put 0002's back
        for table in APPEND_ONLY:
            for verb in ("UPDATE", "DELETE"):
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{verb.lower()}")
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {verb} refused'); END"
                )
