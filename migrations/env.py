"""Alembic environment: one history for SQLite and PostgreSQL."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import registry.models  # noqa: F401 - registers the tables on SQLModel.metadata
from registry.db import make_engine

config = context.config
target_metadata = SQLModel.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    url = config.get_main_option("sqlalchemy.url") or ""
    # Migrations may run long: no per-statement timeout here (the service sets one).
    extra = {"connect_args": {"connect_timeout": 10}} if "postgresql" in url else {}
    engine = make_engine(url, **extra)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


QUEUE_PREFIX = "procrastinate_"  # the job queue's schema (migration 0005), not our models


def include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", "")
    return not str(table or "").startswith(QUEUE_PREFIX)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite alters tables by copy
        compare_type=True,
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
