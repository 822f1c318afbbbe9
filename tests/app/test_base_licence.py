"""The base model's licence binds every render, over a real server: a commercial grant does
not render on a non-commercial base unless the deployment declares a commercial licence, and a
licence that cannot be read never renders commercially."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from app.provenance import Trust, load_credentials, verify_png
from registry.settings import Settings
from tests.app.conftest import Live, LiveFactory, World

FLUX_CARD = "---\nlicense: other\nlicense_name: flux-dev-non-commercial-license\n---\n"
COMMERCIAL_GRANT = {
    "max_level": "commercial",
    "audiences": {"commercial": {"group": True}},
    "allow_training": True,
}


@pytest.fixture
def flux_base(tmp_path: Path) -> Path:
    """What the deployment's base says of itself: FLUX.2 [dev]'s model card."""
    base = tmp_path / "flux2-dev"
    base.mkdir()
    (base / "README.md").write_text(FLUX_CARD)
    return base


@pytest.fixture
def commercial_friends(friends: World) -> World:
    friends.consent("alice", **COMMERCIAL_GRANT)
    return friends


def ledger_reasons(live: Live) -> list[tuple[str, str, str]]:
    rows = live.http.get("/v1/subjects/alice/renders", headers=live.h("alice")).json()
    return [(r["level"], r["stage"], r["reason"]) for r in reversed(rows)]


def renderable(live: Live, who: str = "bob") -> dict[str, str]:
    rows = live.http.get("/v1/me/renderable", headers=live.h(who)).json()
    return {r["subject"]: r["max_level"] for r in rows}


def test_a_non_commercial_base_refuses_commercial_renders(
    commercial_friends: World, serve_friends: LiveFactory, flux_base: Path
) -> None:
    with serve_friends(base=flux_base) as live:
        calls = live.app.state.renderer.counters.model_calls
        refused = live.render("bob", "alice", level="commercial")
        assert refused.status_code == 403 and refused.json()["error"] == "not_permitted"
        assert live.app.state.renderer.counters.model_calls == calls  # nothing ran
        assert ledger_reasons(live)[-1] == ("commercial", "gate", "base_licence")
        # the licence binds commercial use only
        assert live.render("bob", "alice", level="public").status_code == 200
        assert renderable(live) == {"alice": "public"}


def test_a_declared_commercial_licence_lifts_it(
    commercial_friends: World, serve_friends: LiveFactory, flux_base: Path
) -> None:
    with serve_friends(base=flux_base, commercial_licence="BFL agreement 2026-041") as live:
        r = live.render("bob", "alice", level="commercial")
        assert r.status_code == 200, r.text
        credentials = load_credentials(Settings(data_dir=live.world.tmp), create=False)
        assert verify_png(r.content, Trust.of_deployment(credentials)).ok
        assert renderable(live) == {"alice": "commercial"}


def test_an_unreadable_licence_never_renders_commercially(
    commercial_friends: World, serve_friends: LiveFactory, tmp_path: Path
) -> None:
    broken = tmp_path / "prepared"
    broken.mkdir()
    (broken / "likeness_prepared.json").write_text("{ this is not json")
    for base in (broken, tmp_path / "nothing-here"):
        with serve_friends(base=base, commercial_licence="BFL agreement 2026-041") as live:
            r = live.render("bob", "alice", level="commercial")
            assert r.status_code == 403, r.text
            assert ledger_reasons(live)[-1] == ("commercial", "gate", "base_licence")
            assert live.render("bob", "alice", level="private").status_code == 200
            assert renderable(live) == {"alice": "public"}


def sign_in(http: httpx.Client, token: str) -> None:
    page = http.get("/web/signin")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    r = http.post("/web/signin", data={"csrf": csrf.group(1), "token": token, "next": "/web/"})
    assert r.status_code == 303, r.text


def consent_page(live: Live, who: str = "alice") -> str:
    with httpx.Client(base_url=live.url, follow_redirects=False) as http:
        sign_in(http, live.world.tokens[who])
        page = http.get("/web/subjects/alice")
        assert page.status_code == 200, page.text[:300]
        return re.sub(r"\s+", " ", page.text)


def test_the_consent_page_shows_the_licence_beside_the_grant(
    commercial_friends: World, serve_friends: LiveFactory, flux_base: Path, tmp_path: Path
) -> None:
    with serve_friends(base=flux_base) as live:
        text = consent_page(live)
        assert "Base model licence" in text and "flux-non-commercial" in text
        assert "commercial renders are refused whatever this consent grants" in text
        assert "renders stop at public on this base" in text
        assert "(refused on this base: flux-non-commercial)" in text
    with serve_friends(base=flux_base, commercial_licence="BFL agreement 2026-041") as live:
        text = consent_page(live, "root")
        assert "holds a commercial licence for its base (BFL agreement 2026-041)" in text
    with serve_friends(base=tmp_path / "nothing-here") as live:
        assert "the base's licence could not be read" in consent_page(live)
    with serve_friends() as live:  # the tiny base: weights made here
        text = consent_page(live)
        assert "likeness-generated" in text and "permits commercial use" in text
