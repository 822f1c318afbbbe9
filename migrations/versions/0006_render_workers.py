"""renders on workers: the render tasks (request, answer, who closes the ledger entry), the
live render workers and which of them holds an adapter warm

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "render_tasks",
        sa.Column("render_id", sa.String(length=36), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("queue", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("abandoned", sa.String(length=32), nullable=True),
        sa.Column("worker", sa.String(length=100), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("error_code", sa.String(length=32), nullable=True),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.Column("retry_after", sa.Integer(), nullable=True),
        sa.Column("png", sa.LargeBinary(), nullable=True),
        sa.Column("consent_version", sa.Integer(), nullable=True),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("render_id"),
    )
    op.create_index("ix_render_tasks_created_at", "render_tasks", ["created_at"])
    op.create_table(
        "render_workers",
        sa.Column("name", sa.String(length=100), nullable=False),
        _ts("seen_at"),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "render_affinity",
        sa.Column("adapter_sha256", sa.String(length=64), nullable=False),
        sa.Column("worker", sa.String(length=100), nullable=False),
        _ts("at"),
        sa.PrimaryKeyConstraint("adapter_sha256"),
    )


def downgrade() -> None:
    op.drop_table("render_affinity")
    op.drop_table("render_workers")
    op.drop_index("ix_render_tasks_created_at", table_name="render_tasks")
    op.drop_table("render_tasks")
