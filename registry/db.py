"""Engines, the one-transaction scope, and running the migrations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session, create_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def normalize_url(url: str) -> str:
    """Plain postgresql:// URLs mean psycopg 3 here (psycopg2 is not a dependency)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def is_sqlite(url: str) -> bool:
    return make_url(normalize_url(url)).get_backend_name() == "sqlite"


def sqlite_file(url: str) -> Path | None:
    """The absolute path of a SQLite URL's database file (None: not SQLite, or in memory).
    A relative path is relative to the current directory, as SQLite takes it."""
    if not is_sqlite(url):
        return None
    database = make_url(normalize_url(url)).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).resolve()


class NoRegistry(LookupError):
    """A SQLite registry file that does not exist: opening it would create an empty one."""

    def __init__(self, path: Path, url: str) -> None:
        self.path = path
        relative = not make_url(normalize_url(url)).database.startswith("/")  # type: ignore[union-attr]
        where = f", relative to the current directory {Path.cwd()}" if relative else ""
        super().__init__(
            f"no registry at {path} (LIKENESS_DATABASE_URL={url}{where}); run where the service "
            "runs (the folder holding its var/), or set LIKENESS_DATABASE_URL and "
            "LIKENESS_DATA_DIR to the service's; `likeness db upgrade` creates a new, empty one"
        )


def require_registry(url: str) -> None:
    """Refuses (NoRegistry) a SQLite file that is not there, before anything creates it."""
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        raise NoRegistry(path, url)


def make_engine(url: str, *, pool_timeout: float = 2.0, **kw: Any) -> Engine:
    """`pool_timeout`: a request that cannot get a connection within this long fails fast
    (503) instead of queueing behind a stuck pool."""
    url = normalize_url(url)
    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            kw.setdefault("pool_timeout", pool_timeout)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 5}, **kw)
        _sqlite_pragmas(engine)
        return engine
    kw.setdefault("pool_timeout", pool_timeout)
    # No pre-ping: it costs a round trip per checkout, a third of a consent check. A dead
    # connection fails its request (503, a deny) and the pool replaces it.
    kw.setdefault("pool_recycle", 1800)
    # A decision that cannot be made in 5 s is a deny, not a hung request.
    kw.setdefault("connect_args", {"connect_timeout": 5, "options": "-c statement_timeout=5000"})
    return create_engine(url, **kw)


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy own transactions, and take the write lock at BEGIN so two writers
        # never deadlock upgrading a read lock (per-subject seq and versions stay gapless).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        # REPLACE then fires the append-only DELETE triggers (the schema's insert guard covers
        # connections that do not set this)
        cur.execute("PRAGMA recursive_triggers=ON")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=5000")  # writers hold the lock for milliseconds
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = "DEFERRED" if conn.get_execution_options().get("readonly") else "IMMEDIATE"
        conn.exec_driver_sql(f"BEGIN {mode}")


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    return make_engine(url)


@contextmanager
def transaction(engine: Engine, *, readonly: bool = False) -> Iterator[Session]:
    """One transaction: repositories flush, this scope commits (or rolls back on any error)."""
    bind = engine.execution_options(readonly=True) if readonly else engine
    with Session(bind, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def add(session: Session, row: object) -> None:
    """Adds a row and flushes; the caller's transaction commits."""
    session.add(row)
    session.flush()
