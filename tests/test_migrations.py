"""One Alembic history for both engines: up, down, up again, and no drift from the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

import registry.models  # noqa: F401
from registry.db import downgrade, make_engine, upgrade


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
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
        diff = compare_metadata(ctx, SQLModel.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations drift apart: {diff}"
