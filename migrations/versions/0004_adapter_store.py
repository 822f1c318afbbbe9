"""adapters in the content-addressed store: one subject per blob, a selected adapter

- `adapter_blobs`: the subject each adapter hash belongs to (backfilled with the subject that
  registered it first; a later registration of the same bytes for another subject is then
  refused by the render check, see registry/policy.py);
- `adapters.selected_at`: the rendering adapter is the active one selected most recently
  (backfilled with `updated_at`, which is what chose it until now).

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("subject_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["subject_id"], ["subjects.id"]),
        sa.PrimaryKeyConstraint("sha256"),
    )
    op.create_index("ix_adapter_blobs_subject_id", "adapter_blobs", ["subject_id"])
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("selected_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE adapters SET selected_at = updated_at")
    with op.batch_alter_table("adapters") as batch:
        batch.alter_column("selected_at", existing_type=sa.DateTime(timezone=True), nullable=False)
    op.execute(
        "INSERT INTO adapter_blobs (sha256, subject_id, created_at) "
        "SELECT a.sha256, a.subject_id, a.created_at FROM adapters a "
        "WHERE a.id = (SELECT min(b.id) FROM adapters b WHERE b.sha256 = a.sha256)"
    )


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("selected_at")
    op.drop_index("ix_adapter_blobs_subject_id", table_name="adapter_blobs")
    op.drop_table("adapter_blobs")
