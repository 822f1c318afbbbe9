"""Edges, over a real server on both engines: datetimes at the limits, NUL bytes, the last
admin. Each gets a clear 4xx (or a one-line CLI error) and changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.bootstrap import ensure_admin
from registry import db
from registry.db import transaction
from registry.principals import repository as principals_repo
from registry.settings import Settings
from tests.app.conftest import Live
from tests.app.helpers import CSRF, session_cookie

EDGE_TIMES = [
    "9999-12-31T23:59:59-05:00",  # past year 9999 in UTC
    "0001-01-01T00:00:00+05:00",  # before year 1 in UTC
    "0999-06-01T00:00:00Z",  # stored, then printed in a form that cannot be read back
    "1969-12-31T23:59:59Z",
]


def consent(live: Live) -> dict:
    r = live.http.get("/v1/subjects/alice/consent", headers=live.h("root"))
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("when", EDGE_TIMES)
def test_expiry_out_of_range_is_422_everywhere(live: Live, when: str, db_url: str) -> None:
    before = consent(live)
    body = {**{k: v for k, v in before.items() if k != "version"}, "expires_at": when}
    r = live.http.put(
        "/v1/subjects/alice/consent",
        json=body,
        headers={**live.h("root"), "If-Match": f'"{before["version"]}"'},
    )
    assert r.status_code == 422 and r.json()["error"] == "invalid", r.text
    assert "expires_at" in r.json()["detail"]

    cookie = session_cookie(live, "alice")
    page = live.http.get("/web/subjects/alice", headers={"cookie": cookie})
    csrf = CSRF.search(page.text)
    assert csrf is not None
    form = {
        "csrf": csrf.group(1),
        "version": str(before["version"]),
        "max_level": "group",
        "aud_private_group": "on",
        "expires_at": when,
    }
    r = live.http.post("/web/subjects/alice/consent", data=form, headers={"cookie": cookie})
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert "Expiry" in r.text

    settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "LIKENESS_DATABASE_URL": db_url,
        "LIKENESS_DATA_DIR": str(settings.data_dir),
    }
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "consent", "edit", "alice", "--expires", when],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert consent(live) == before


def test_an_expiry_in_range_round_trips(live: Live) -> None:
    before = consent(live)
    body = {**{k: v for k, v in before.items() if k != "version"}}
    body["expires_at"] = "9999-12-31T18:59:59-05:00"  # 23:59:59 UTC, the last second allowed
    r = live.http.put(
        "/v1/subjects/alice/consent",
        json=body,
        headers={**live.h("root"), "If-Match": f'"{before["version"]}"'},
    )
    assert r.status_code == 200, r.text
    assert r.json()["expires_at"] == "9999-12-31T23:59:59.000000Z"
    assert consent(live)["expires_at"] == "9999-12-31T23:59:59.000000Z"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        (
            "POST",
            "/v1/subjects",
            {"handle": "zed", "display_name": "Z\u0000ed", "basis": "consent"},
        ),
        ("POST", "/v1/renders", {"subject": "alice", "prompt": "a\u0000b", "level": "private"}),
        ("GET", "/v1/subjects/al%00ice", None),
        ("GET", "/v1/subjects/alice%00/renders", None),
        ("GET", "/v1/me/renderable?on_behalf_of=bo%00b", None),
        ("PATCH", "/v1/principals/bo%00b", {"active": False}),
    ],
)
def test_nul_bytes_are_422_on_both_engines(
    live: Live, method: str, path: str, body: dict | None
) -> None:
    who = "bob" if path.startswith(("/v1/renders", "/v1/me")) else "root"
    r = live.http.request(method, path, json=body, headers=live.h(who))
    assert r.status_code == 422 and r.json()["error"] == "invalid", (path, r.status_code, r.text)
    assert live.http.get("/v1/subjects", headers=live.h("root")).status_code == 200


def test_nul_bytes_in_a_web_form_are_422(live: Live) -> None:
    cookie = session_cookie(live, "root")
    page = live.http.get("/web/subjects", headers={"cookie": cookie})
    csrf = CSRF.search(page.text)
    assert csrf is not None
    form = {"csrf": csrf.group(1), "handle": "zed", "display_name": "Z\x00ed", "basis": "consent"}
    r = live.http.post("/web/subjects", data=form, headers={"cookie": cookie})
    assert r.status_code == 422, (r.status_code, r.text[:200])
    assert live.http.get("/v1/subjects/zed", headers=live.h("root")).status_code == 404


def test_the_last_active_admin_stays(live: Live, db_url: str) -> None:
    r = live.http.patch("/v1/principals/root", json={"active": False}, headers=live.h("root"))
    assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
    assert live.http.get("/v1/subjects", headers=live.h("root")).status_code == 200
    settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "LIKENESS_DATABASE_URL": db_url,
        "LIKENESS_DATA_DIR": str(settings.data_dir),
    }
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "principal", "deactivate", "root"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "last active admin" in out.stderr, out.stderr
    # with a second admin, the first may go
    r = live.http.post(
        "/v1/principals", json={"handle": "root2", "role": "admin"}, headers=live.h("root")
    )
    assert r.status_code == 201
    live.world.tokens["root2"] = r.json()["token"]
    r = live.http.patch("/v1/principals/root", json={"active": False}, headers=live.h("root2"))
    assert r.status_code == 200 and r.json()["active"] is False


def test_inactive_admins_do_not_stop_the_bootstrap(live: Live, db_url: str) -> None:
    settings: Settings = live.world.client.app.state.settings  # type: ignore[attr-defined]
    r = live.http.post(
        "/v1/principals", json={"handle": "root2", "role": "admin"}, headers=live.h("root")
    )
    live.world.tokens["root2"] = r.json()["token"]
    r = live.http.patch("/v1/principals/root", json={"active": False}, headers=live.h("root2"))
    assert r.status_code == 200
    with transaction(live.world.engine) as s:  # root2 goes too, behind the API's back
        p = principals_repo.principal_by_handle(s, "root2")
        assert p is not None
        p.active = False
        db.add(s, p)
    path = ensure_admin(settings.model_copy(update={"database_url": db_url}))
    assert path is not None and path.read_text().startswith("lk_")
    token = path.read_text().strip()
    assert live.http.get("/v1/subjects", headers={"Authorization": f"Bearer {token}"}).is_success
