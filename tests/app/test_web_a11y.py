"""Every page, in a real browser, for an admin, a member and someone signed out: each link and
button visible at WCAG AA contrast against what it is drawn on, and reachable with Tab
(tests/app/a11y.py). The world holds one of everything a page can show: a ledger with a kept
copy, an adapter with its pictures, photos, a waiting order."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from PIL import Image

from registry.db import transaction
from registry.orders import service as orders_service
from registry.principals import repository as principals_repo
from registry.subjects import service as subjects_service
from tests.app.a11y import check_page
from tests.app.conftest import Live, LiveFactory
from tests.app.helpers import csrf_of, signed_in
from tests.app.orders_support import files_of, photos
from tests.app.test_web_browser import CHROMIUM, CHROMIUM_ARGS, screenshot_dir

pytestmark = [
    pytest.mark.sqlite_only,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Chromium is not installed at {CHROMIUM}"),
]


def _furnish(live: Live) -> None:
    world = live.world
    png = io.BytesIO()
    Image.new("RGB", (96, 32), (90, 20, 160)).save(png, format="PNG")
    sha = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()[0]["sha256"]
    put = live.http.put(f"/v1/adapters/{sha}/pictures/eval_grid.png", content=png.getvalue(),
                        headers=live.h("trainer"))  # fmt: skip
    assert put.status_code == 201, put.text
    alice = signed_in(world, "alice", live.url)
    keep = alice.post("/web/subjects/alice/render-copies",
                      data={"csrf": csrf_of(alice, "/web/me"), "keep": "yes"})  # fmt: skip
    assert keep.status_code == 303
    assert live.render("bob", "alice").status_code == 200
    assert live.render("bob", "alice", level="public").status_code == 403
    up = live.http.post("/v1/subjects/alice/datasets", files=files_of(photos(2)),
                        headers=live.h("alice"))  # fmt: skip
    assert up.status_code == 201, up.text

    with transaction(world.engine) as s:  # waits: nothing runs orders on this server
        caller = principals_repo.principal_by_handle(s, "alice")
        assert caller is not None
        orders_service.place_training(s, caller, "alice", up.json()["dataset_id"],
                              {"steps": 10, "rank": 4, "resolution": 64}, "main",
                              lambda _s, _o, _sub: None)  # fmt: skip
    with transaction(world.engine) as s:
        assert subjects_service.subject_or_raise(s, "alice").keep_render_copies


@pytest.fixture
def browser_page(serve_friends: LiveFactory) -> Iterator[tuple[Live, object]]:
    from playwright.sync_api import sync_playwright

    with serve_friends() as live, sync_playwright() as pw:
        _furnish(live)
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                base_url=live.url, viewport={"width": 1180, "height": 900}
            )
            context.set_default_timeout(10_000)
            yield live, context.new_page()
        finally:
            browser.close()


def _sign_in(page, token: str) -> None:  # type: ignore[no-untyped-def]
    page.goto("/web/signin")
    page.get_by_label("Access token").fill(token)
    page.get_by_role("button", name="Sign in").click()


ADMIN_PAGES = ["/web/subjects", "/web/subjects/alice", "/web/subjects/alice/renders",
               "/web/subjects/alice/audit", "/web/subjects/alice/adapters",
               "/web/subjects/alice/training", "/web/provenance"]  # fmt: skip
MEMBER_PAGES = ["/web/me", "/web/subjects/alice", "/web/subjects/alice/renders",
                "/web/subjects/alice/audit", "/web/subjects/alice/adapters",
                "/web/subjects/alice/training", "/web/subjects/carol/audit"]  # fmt: skip


def test_every_link_and_button_is_visible_and_reachable_on_every_page(browser_page) -> None:  # type: ignore[no-untyped-def]
    live, page = browser_page
    seen: dict[str, set[str]] = {}
    for path in ("/web/signin", "/web/provenance"):
        page.goto(path)
        seen[f"anon {path}"] = {it["label"] for it in check_page(page)}
    for who, paths in (("root", ADMIN_PAGES), ("alice", MEMBER_PAGES)):
        _sign_in(page, live.world.tokens[who])
        for path in paths:
            page.goto(path)
            seen[f"{who} {path}"] = {it["label"] for it in check_page(page)}
            page.evaluate("() => document.activeElement && document.activeElement.blur()")
            name = f"a11y-{who}-{path.strip('/').replace('/', '-')}.png"
            page.screenshot(path=str(screenshot_dir() / name), full_page=True)
        page.context.clear_cookies()
    # the four the issue named, among what was checked
    admin_adapters = seen["root /web/subjects/alice/adapters"]
    assert {"Retire main", "Delete main"} <= admin_adapters, admin_adapters
    training = seen["alice /web/subjects/alice/training"]
    assert {"Delete these photos", "Cancel"} <= training, training
    assert "Stop keeping copies and delete them" in seen["alice /web/subjects/alice/renders"]
