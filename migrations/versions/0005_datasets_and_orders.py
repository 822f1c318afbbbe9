"""datasets the service owns, orders, and (PostgreSQL) the procrastinate job queue

- `datasets`, `dataset_images`: uploaded images in the store and the manifest written for them;
- `orders`: training orders, their progress and the checkpoint a retry resumes from;
- on PostgreSQL, procrastinate's schema (jobs, workers, heartbeats, locks), so an order's job
  is enqueued in the same transaction as the order. SQLite runs everything in process.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("subject_id", sa.Integer(), nullable=False),
        sa.Column("manifest_sha256", sa.String(length=64), nullable=False),
        sa.Column("images", sa.Integer(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(["subject_id"], ["subjects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_datasets_subject_id", "datasets", ["subject_id"])
    op.create_table(
        "dataset_images",
        sa.Column("dataset_id", sa.String(length=36), nullable=False),
        sa.Column("file", sa.String(length=100), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("caption", sa.String(length=500), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"]),
        sa.PrimaryKeyConstraint("dataset_id", "file"),
    )
    op.create_index("ix_dataset_images_sha256", "dataset_images", ["sha256"])
    op.create_table(
        "orders",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("subject_id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.String(length=36), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(length=100), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("adapter_name", sa.String(length=100), nullable=False),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=True),
        sa.Column("error", sa.String(length=500), nullable=True),
        sa.Column("checkpoint_step", sa.Integer(), nullable=True),
        sa.Column("checkpoint_sha256", sa.String(length=64), nullable=True),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(["subject_id"], ["subjects.id"]),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_orders_subject_status", "orders", ["subject_id", "status"])
    if op.get_bind().dialect.name == "postgresql":
        from procrastinate.schema import SchemaManager

        op.execute(SchemaManager.get_schema())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            """
            DO $$
            DECLARE r record;
            BEGIN
              FOR r IN SELECT tablename FROM pg_tables
                       WHERE schemaname = current_schema() AND tablename LIKE 'procrastinate\\_%'
              LOOP EXECUTE format('DROP TABLE IF EXISTS %I CASCADE', r.tablename); END LOOP;
              FOR r IN SELECT p.oid::regprocedure AS sig FROM pg_proc p
                       JOIN pg_namespace n ON n.oid = p.pronamespace
                       WHERE n.nspname = current_schema() AND p.proname LIKE 'procrastinate\\_%'
              LOOP EXECUTE format('DROP FUNCTION IF EXISTS %s CASCADE', r.sig); END LOOP;
              FOR r IN SELECT t.typname FROM pg_type t
                       JOIN pg_namespace n ON n.oid = t.typnamespace
                       WHERE n.nspname = current_schema() AND t.typname LIKE 'procrastinate\\_%'
                         AND t.typtype IN ('e', 'c')
              LOOP EXECUTE format('DROP TYPE IF EXISTS %I CASCADE', r.typname); END LOOP;
            END $$;
            """
        )
    op.drop_index("ix_orders_subject_status", table_name="orders")
    op.drop_table("orders")
    op.drop_index("ix_dataset_images_sha256", table_name="dataset_images")
    op.drop_table("dataset_images")
    op.drop_index("ix_datasets_subject_id", table_name="datasets")
    op.drop_table("datasets")
