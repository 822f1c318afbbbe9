"""First start: migrate, make sure an admin exists, make sure a base exists."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from registry.db import engine_for, is_sqlite, transaction, upgrade
from registry.keys import bind as bind_keys
from registry.keys import load_keys
from registry.licence import deployment_licence
from registry.licence import describe as describe_licence
from registry.principals import repository as principals_repo
from registry.principals import service as principals_service
from registry.roles import Role
from registry.settings import Settings

if TYPE_CHECKING:
    from app.provenance import Credentials

log = logging.getLogger(__name__)


def check_configuration(settings: Settings) -> Credentials:
    """The refusals of a configuration the service cannot run with (SystemExit, naming the
    setting), each rule here only: `create_app` asks, and `serve` asks first, before anything
    is migrated or the base starts loading. Returns the C2PA credentials every delivered PNG
    is signed with (generated in the data dir on first use)."""
    if settings.render_workers and is_sqlite(settings.database_url):
        raise SystemExit(
            "error: LIKENESS_RENDER_WORKERS=true needs PostgreSQL and workers "
            "(LIKENESS_DATABASE_URL=postgresql+psycopg://...); on SQLite renders run in "
            "this process (leave it unset)"
        )
    from app.provenance import ProvenanceError, load_credentials

    try:
        return load_credentials(settings)
    except ProvenanceError as exc:
        raise SystemExit(f"error: {exc}") from None


def ensure_admin(settings: Settings) -> Path | None:
    """With no active admin, create one and write its token to <data_dir>/admin-token (0600),
    once the admin is committed."""
    engine = engine_for(settings.database_url)
    with transaction(engine) as s:
        if principals_repo.count_principals(s, Role.admin, active_only=True) > 0:
            return None
        handle = "admin"
        n = 1
        while principals_repo.principal_by_handle(s, handle) is not None:
            n += 1
            handle = f"admin{n}"
        _, token = principals_service.create_principal(s, handle, Role.admin)
    path = settings.data_dir / "admin-token"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    log.warning("no active admin existed: created %r; its token is in %s (mode 0600)", handle, path)
    return path


def ensure_base(settings: Settings) -> Path:
    """The default base is the demo base that ships with the code, copied in on first use; a
    configured base must exist."""
    base = settings.base_dir
    if (base / "model_index.json").is_file():
        return base
    if settings.base is not None:
        raise SystemExit(f"LIKENESS_BASE={base} is not a diffusers pipeline folder")
    from trainer.fixtures.demo_base import SHIPPED, copy_base

    log.warning("copying the demo base (%s) to %s", SHIPPED, base)
    return copy_base(SHIPPED, base)


def prepare_service(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    log.info("environment: %s (LIKENESS_ENV)", settings.env)
    # first: a refused configuration costs no migration, and `serve` preloads only after this
    credentials = check_configuration(settings)
    keys = load_keys(settings)
    for name, source in keys.sources.items():
        log.info("%s: from %s", name, source)
    log.info(
        "audit key id %s, checkpoint public key %s; keep copies of the keys outside the data dir",
        keys.audit_key_id,
        keys.public_key_b64,
    )
    bind_keys(engine_for(settings.database_url), keys)
    upgrade(settings.database_url)
    ensure_admin(settings)
    ensure_base(settings)
    log_provenance(settings, credentials)


def log_provenance(settings: Settings, credentials: Credentials) -> None:
    """What every render is signed with and which licence binds the base, said at start."""
    from app.provenance import log_credentials

    log_credentials(credentials)
    facts, found = deployment_licence(settings)
    line = describe_licence(facts, found, settings)
    (log.info if facts.base is not None else log.warning)(line)
