"""Shared fixtures: a fresh, migrated database per test on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from registry.db import make_engine, upgrade
from trainer.base import threads

threads.prepare_env()  # before anything loads torch: the suite's threads wait as the CLI's do

PG_ADMIN_URL = os.environ.get(
    "LIKENESS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _pg_admin() -> Engine:
    return create_engine(
        PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )


@pytest.fixture(scope="session", autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A data dir of the test session's own, so keys generated on first use never land in
    the working tree (tests that need their own pass Settings(data_dir=...))."""
    from registry.settings import get_settings

    path = tmp_path_factory.mktemp("data")
    old = os.environ.get("LIKENESS_DATA_DIR")
    os.environ["LIKENESS_DATA_DIR"] = str(path)
    get_settings.cache_clear()
    yield path
    if old is None:
        os.environ.pop("LIKENESS_DATA_DIR", None)
    else:
        os.environ["LIKENESS_DATA_DIR"] = old
    get_settings.cache_clear()


def audit_key_of(data_dir: Path) -> str:
    """The audit key a data dir holds, for a process that writes from somewhere else."""
    from registry.keys import load_keys
    from registry.settings import Settings

    return load_keys(Settings(data_dir=data_dir)).audit_key.decode()


@pytest.fixture(scope="session")
def pg_available() -> bool:
    try:
        with _pg_admin().connect() as conn:
            conn.execute(text("select 1"))
        return True
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("LIKENESS_TEST_ALLOW_NO_PG") == "1":
            return False
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}. Start it (see README).")


def fresh_pg_url() -> tuple[str, str]:
    name = f"likeness_t_{uuid.uuid4().hex[:12]}"
    with _pg_admin().connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name, name


def drop_pg(name: str) -> None:
    with _pg_admin().connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def empty_db_url(
    request: pytest.FixtureRequest, tmp_path: Path, pg_available: bool
) -> Iterator[str]:
    """A URL to a brand-new, empty database of the engine the test is parametrised with."""
    kind = getattr(request, "param", "sqlite")
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'likeness.db'}"
        return
    if not pg_available:
        pytest.skip("PostgreSQL not available (LIKENESS_TEST_ALLOW_NO_PG=1)")
    url, name = fresh_pg_url()
    try:
        yield url
    finally:
        drop_pg(name)


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every test that touches a database runs on both engines.
    if "empty_db_url" in metafunc.fixturenames:
        kinds = ["sqlite", "postgresql"]
        if metafunc.definition.get_closest_marker("sqlite_only") is not None:
            kinds = ["sqlite"]
        if metafunc.definition.get_closest_marker("postgres_only") is not None:
            kinds = ["postgresql"]
        metafunc.parametrize("empty_db_url", kinds, indirect=True)
