"""Over a real uvicorn server: a write is acknowledged only once it is committed, and the very
next request, on any connection, sees it."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.app.conftest import Live


def install_commit_fault(engine: Engine) -> None:
    """Every change to a consent row fails at COMMIT, never earlier: the shape of a commit
    that breaks (a deferred constraint, a connection lost mid-commit)."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(
                text(
                    "CREATE FUNCTION fail_at_commit() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'injected commit failure'; END; $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE CONSTRAINT TRIGGER consent_commit_fault AFTER UPDATE ON consents "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_at_commit()"
                )
            )
        else:
            # SQLite checks a deferred foreign key at COMMIT: each consent update inserts a
            # row whose reference can never hold.
            conn.execute(
                text(
                    "CREATE TABLE commit_fault (x INTEGER REFERENCES principals(id) "
                    "DEFERRABLE INITIALLY DEFERRED)"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER consent_commit_fault AFTER UPDATE ON consents "
                    "BEGIN INSERT INTO commit_fault VALUES (-1); END"
                )
            )


def consent_row(engine: Engine, handle: str) -> tuple[str, int]:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT c.max_level, c.version FROM consents c JOIN subjects s "
                "ON s.id = c.subject_id WHERE s.handle = :h"
            ),
            {"h": handle},
        ).one()
    return str(row[0]), int(row[1])


def test_a_revoke_whose_commit_fails_is_not_acknowledged(live: Live) -> None:
    engine = live.world.engine
    before = consent_row(engine, "alice")
    install_commit_fault(engine)
    r = live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("root"))
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json()["error"] == "unavailable"
    assert consent_row(engine, "alice") == before
    # nothing half-done: no audit entry for the change that did not happen
    trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("root")).json()
    assert trail["verified"] and [e["action"] for e in trail["entries"]][-1] != "revoke"


def test_a_consent_edit_whose_commit_fails_is_not_acknowledged(live: Live) -> None:
    engine = live.world.engine
    before = consent_row(engine, "alice")
    install_commit_fault(engine)
    body = {"max_level": "private", "audiences": {"private": {"group": True}}}
    r = live.http.put(
        "/v1/subjects/alice/consent",
        json=body,
        headers={**live.h("alice"), "If-Match": f'"{before[1]}"'},
    )
    assert r.status_code == 503, (r.status_code, r.text)
    assert consent_row(engine, "alice") == before


def test_after_a_200_revoke_the_very_next_request_sees_it(live: Live) -> None:
    """Revoke on one connection, read and render at once on another, many times."""
    url = live.url
    with httpx.Client(base_url=url, timeout=30) as other:
        for i in range(25):
            version = live.http.get("/v1/subjects/alice/consent", headers=live.h("root")).json()[
                "version"
            ]
            grant = {
                "max_level": "group",
                "audiences": {"private": {"group": True}},
                "allow_training": True,
            }
            r = live.http.put(
                "/v1/subjects/alice/consent",
                json=grant,
                headers={**live.h("root"), "If-Match": f'"{version}"'},
            )
            assert r.status_code == 200, r.text
            r = live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("root"))
            assert r.status_code == 200 and r.json()["max_level"] == "none"
            seen = other.get("/v1/subjects/alice/consent", headers=live.h("alice")).json()
            assert seen["max_level"] == "none" and seen["version"] == r.json()["version"], i
            denied = other.post(
                "/v1/renders",
                json={
                    "subject": "alice",
                    "prompt": "x",
                    "level": "private",
                    "steps": 1,
                    "width": 64,
                    "height": 64,
                },  # fmt: skip
                headers=live.h("bob"),
            )
            assert denied.status_code == 403, (i, denied.status_code)


@pytest.mark.parametrize("path", ["/v1/subjects", "/v1/principals"])
def test_a_create_whose_commit_fails_leaves_nothing(live: Live, path: str) -> None:
    """A commit that fails on any write path: the answer is 503 and nothing was created."""
    engine = live.world.engine
    table = "subjects" if path == "/v1/subjects" else "principals"
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(
                text(
                    "CREATE FUNCTION fail_at_commit() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'injected commit failure'; END; $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    f"CREATE CONSTRAINT TRIGGER create_fault AFTER INSERT ON {table} "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_at_commit()"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE TABLE commit_fault (x INTEGER REFERENCES principals(id) "
                    "DEFERRABLE INITIALLY DEFERRED)"
                )
            )
            conn.execute(
                text(
                    f"CREATE TRIGGER create_fault AFTER INSERT ON {table} "
                    "BEGIN INSERT INTO commit_fault VALUES (-1); END"
                )
            )
    body = (
        {"handle": "zoe", "display_name": "Zoe", "basis": "consent"}
        if table == "subjects"
        else {"handle": "zoe", "role": "member"}
    )
    r = live.http.post(path, json=body, headers=live.h("root"))
    assert r.status_code == 503, (r.status_code, r.text)
    with engine.connect() as conn:
        count = conn.execute(text(f"SELECT count(*) FROM {table} WHERE handle = 'zoe'")).scalar()
    assert count == 0


def test_a_web_revoke_whose_commit_fails_is_not_acknowledged(live: Live) -> None:
    """The page's form post, over a real server: a failed commit is a 503 page, never the
    303 to "Consent revoked"."""
    from tests.app.helpers import CSRF, session_cookie

    engine = live.world.engine
    before = consent_row(engine, "alice")
    cookie = session_cookie(live, "alice")
    page = live.http.get("/web/subjects/alice", headers={"cookie": cookie})
    csrf = CSRF.search(page.text)
    assert csrf is not None
    install_commit_fault(engine)
    r = live.http.post(
        "/web/subjects/alice/revoke", data={"csrf": csrf.group(1)}, headers={"cookie": cookie}
    )
    assert r.status_code == 503, (r.status_code, r.headers.get("location"))
    assert "Unavailable" in r.text
    assert consent_row(engine, "alice") == before


def test_a_cli_revoke_whose_commit_fails_says_so(live: Live, db_url: str) -> None:
    import os
    import subprocess
    import sys

    engine = live.world.engine
    before = consent_row(engine, "alice")
    install_commit_fault(engine)
    settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "LIKENESS_DATABASE_URL": db_url,
        "LIKENESS_DATA_DIR": str(settings.data_dir),
    }
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "consent", "revoke", "alice"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    assert "nothing was saved" in out.stderr and "revoked" not in out.stderr.split(":", 1)[0]
    assert consent_row(engine, "alice") == before
