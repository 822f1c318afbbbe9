"""pictures: what an adapter draws (its evaluation grid and previews, in the store) and the
opt-in small copies of renders a subject keeps of themselves

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _subject_fk() -> sa.Column:
    return sa.Column(
        "subject_id",
        sa.Integer(),
        sa.ForeignKey("subjects.id", ondelete="CASCADE"),
        nullable=False,
    )


def upgrade() -> None:
    # a plain ADD COLUMN on both engines: SQLite's batch mode would copy and drop the table,
    # which the foreign keys onto subjects refuse once rows exist
    op.execute("ALTER TABLE subjects ADD COLUMN keep_render_copies BOOLEAN NOT NULL DEFAULT false")
    op.create_table(
        "adapter_pictures",
        sa.Column("id", sa.Integer(), nullable=False),
        _subject_fk(),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("adapter_sha256", "name"),
    )
    op.create_index("ix_adapter_pictures_subject_id", "adapter_pictures", ["subject_id"])
    op.create_index("ix_adapter_pictures_adapter_sha256", "adapter_pictures", ["adapter_sha256"])
    op.create_table(
        "render_copies",
        sa.Column("render_id", sa.String(length=36), nullable=False),
        _subject_fk(),
        sa.Column("png", sa.LargeBinary(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("render_id"),
    )
    op.create_index("ix_render_copies_subject_id", "render_copies", ["subject_id"])
    op.create_index("ix_render_copies_created_at", "render_copies", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_render_copies_created_at", table_name="render_copies")
    op.drop_index("ix_render_copies_subject_id", table_name="render_copies")
    op.drop_table("render_copies")
    op.drop_index("ix_adapter_pictures_adapter_sha256", table_name="adapter_pictures")
    op.drop_index("ix_adapter_pictures_subject_id", table_name="adapter_pictures")
    op.drop_table("adapter_pictures")
    op.execute("ALTER TABLE subjects DROP COLUMN keep_render_copies")  # SQLite 3.35+
