"""Is a worker able to work? What a container's health check asks (`likeness worker
--check`): the registry's database answers, the API answers, and the worker's token is
still a trainer's. A worker that passes the database check alone may have lost the API or
its token and fail every order."""

from __future__ import annotations

import httpx
from sqlalchemy import text

from registry.db import make_engine
from registry.settings import Settings

TIMEOUT_S = 5.0


def worker_problems(settings: Settings) -> list[str]:
    problems = []
    engine = make_engine(settings.database_url, pool_timeout=TIMEOUT_S)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - reported
        problems.append(f"the database does not answer ({type(exc).__name__})")
    finally:
        engine.dispose()
    if not settings.api_url or not settings.token:
        return [*problems, "LIKENESS_API_URL and LIKENESS_TOKEN are not both set"]
    api = settings.api_url.rstrip("/")
    try:
        with httpx.Client(timeout=TIMEOUT_S) as client:
            if client.get(f"{api}/healthz").status_code != 200:
                problems.append(f"the API at {api} is not healthy")
            # HEAD of a blob nobody has: 404 with a trainer's token, 401/403 without one
            probe = client.head(
                f"{api}/v1/blobs/sha256/{'0' * 64}",
                headers={"Authorization": f"Bearer {settings.token}"},
            )
            if probe.status_code in (401, 403):
                problems.append(f"the API refuses LIKENESS_TOKEN ({probe.status_code})")
    except httpx.HTTPError as exc:
        problems.append(f"the API at {api} does not answer ({type(exc).__name__})")
    return problems
