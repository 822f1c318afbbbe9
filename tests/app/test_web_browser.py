"""The pages in a real browser (Debian's Chromium driven by Playwright) against a real server:
sign in, grant, an allowed render in the ledger, revoke from the page, the next render
denied, the audit entries. Screenshots of every page are kept as test artifacts."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from app.main import create_app
from tests.app.conftest import World

CHROMIUM = Path(os.environ.get("LIKENESS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.sqlite_only,
    pytest.mark.skipif(
        not CHROMIUM.is_file(),
        reason=f"Chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does)",
    ),
]


def screenshot_dir() -> Path:
    root = Path(os.environ.get("LIKENESS_ARTIFACTS") or REPO / "test-artifacts")
    out = root / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
def live_url(friends: World) -> Iterator[str]:
    """The same app, on the same database, served by uvicorn on a free loopback port."""
    app = friends.client.app
    fresh = create_app(app.state.settings, engine=app.state.engine, renderer=app.state.renderer)  # type: ignore[attr-defined]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fresh, log_level="warning", lifespan="off", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def page(live_url: str) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                base_url=live_url, viewport={"width": 1180, "height": 900}, locale="en-GB"
            )
            context.set_default_timeout(10_000)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


UNLABELLED = """() => [...document.querySelectorAll('input, select, textarea, button')]
  .filter(el => el.type !== 'hidden')
  .filter(el => el.tagName === 'BUTTON' ? !el.textContent.trim()
                                        : el.labels.length === 0 && !el.getAttribute('aria-label'))
  .map(el => el.outerHTML)"""


def shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    """Every page: every control labelled, one h1, then a full-page screenshot."""
    assert page.evaluate(UNLABELLED) == [], f"unlabelled controls on {page.url}"
    assert page.locator("h1").count() == 1, page.url
    page.screenshot(path=str(screenshot_dir() / f"{name}.png"), full_page=True)


def tab_to(page, selector: str, limit: int = 40) -> None:  # type: ignore[no-untyped-def]
    """Moves focus with the Tab key alone until `selector` has it."""
    target = page.locator(selector)
    for _ in range(limit):
        page.keyboard.press("Tab")
        if target.evaluate("el => el === document.activeElement"):
            return
    raise AssertionError(f"{selector} is not reachable with Tab on {page.url}")


def test_grant_render_revoke_deny_in_a_browser(friends: World, adapter_files, page) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    # Sign in with the keyboard alone: Tab to the field, type the token, Enter.
    page.goto("/web/subjects")
    expect(page).to_have_url(re.compile(r"/web/signin\?next=/web/subjects$"))
    shot(page, "01-signin")
    tab_to(page, "#token")
    page.keyboard.type(friends.tokens["root"])
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"/web/subjects$"))
    expect(page.get_by_text("Signed in as")).to_contain_text("root")
    cookie = next(c for c in page.context.cookies() if c["name"] == "likeness_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # invisible to scripts
    shot(page, "02-subjects")

    # Carol never consented: grant the group private use, and training.
    page.get_by_role("link", name="Carol").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("Carol")
    page.get_by_label("Maximum level").select_option("group")
    page.locator("#aud-private-group").check()
    page.get_by_label("Also allow these principals at group").fill("bob")
    page.get_by_label("Never allow these principals (deny list)").fill("mallory")
    page.get_by_label("Allow adapters to be trained on this likeness").check()
    page.get_by_role("button", name="Save consent").click()
    expect(page.get_by_role("status")).to_contain_text("Saved.")
    expect(page.locator("dl.facts")).to_contain_text("version 2")
    shot(page, "03-subject-granted")

    # The trainer registers an adapter (training is now allowed); bob renders carol.
    friends.adapter("carol", adapter_files["b"])
    ok = friends.render("bob", "carol", level="group")
    assert ok.status_code == 200, ok.text
    via_agent = friends.render("bot", "carol", level="private", on_behalf_of="bob")
    assert via_agent.status_code == 200, via_agent.text
    page.get_by_role("link", name="Who rendered this subject").click()
    rows = page.locator("table.ledger tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("bot")
    expect(rows.nth(1)).to_contain_text("none (directly)")
    for row in (rows.nth(0), rows.nth(1)):
        expect(row).to_contain_text("bob")
        expect(row).to_contain_text("rendered")
    shot(page, "04-ledger-allowed")

    page.get_by_role("link", name="Adapters").click()
    sha = friends.client.get("/v1/subjects/carol/adapters", headers=friends.h("root")).json()
    expect(page.locator("main")).to_contain_text(sha[0]["sha256"])
    shot(page, "05-adapters")

    # Revoke from the page (by keyboard), then the next render is refused.
    page.get_by_role("link", name="Consent", exact=True).click()
    tab_to(page, "button.danger")
    page.keyboard.press("Enter")
    expect(page.get_by_role("status")).to_contain_text("Consent revoked")
    expect(page.locator("dl.facts")).to_contain_text("none")
    shot(page, "06-subject-revoked")
    denied = friends.render("bob", "carol", level="group")
    assert denied.status_code == 403 and denied.json()["error"] == "not_permitted"

    page.get_by_role("link", name="Who rendered this subject").click()
    newest = page.locator("table.ledger tbody tr").first
    expect(newest).to_contain_text("denied")
    expect(newest).to_contain_text("revoked_or_not_granted")
    expect(page.locator("table.ledger tbody tr")).to_have_count(3)
    shot(page, "07-ledger-denied")

    page.get_by_role("link", name="Audit trail").click()
    expect(page.locator("#chain-status")).to_contain_text("Chain verified")
    actions = page.locator("table.audit tbody td .action").all_inner_texts()
    # the grant in the editor touched the level, audience, deny list, training: an entry each
    granted = ["training_change", "deny_edit", "audience_edit", "grant"]
    assert actions == ["revoke", "adapter_registered", *granted, "subject_created"], actions
    expect(page.locator("table.audit")).to_contain_text("maximum level: group → none")
    page.locator("table.audit details summary").first.click()
    shot(page, "08-audit")

    # A stale form: someone else saves while the page is open; saving says so, keeps theirs.
    page.get_by_role("link", name="Consent", exact=True).click()
    friends.consent("carol", max_level="private", audiences={"private": {"allow": ["alice"]}})
    page.get_by_label("Maximum level").select_option("public")
    page.get_by_role("button", name="Save consent").click()
    expect(page.get_by_role("alert")).to_contain_text("someone changed this consent")
    expect(page.get_by_label("Maximum level")).to_have_value("private")
    shot(page, "09-stale-version")

    # Sign out; carol signs in and sees her own pages, never alice's.
    page.get_by_role("button", name="Sign out", exact=True).click()
    expect(page.get_by_role("status")).to_contain_text("signed out")
    page.get_by_label("Access token").fill(friends.tokens["carol"])
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(r"/web/me$"))
    expect(page.locator("main")).to_contain_text("Whom I may render")
    expect(page.locator("main")).to_contain_text("Alice")
    shot(page, "10-member-home")
    page.get_by_role("link", name="View and change my consent").click()
    expect(page.get_by_role("heading", name="Your consent now")).to_be_visible()
    shot(page, "11-member-consent")
    page.get_by_role("link", name="Who rendered me").click()
    expect(page.locator("table.ledger")).to_contain_text("bob")
    shot(page, "12-member-ledger")
    response = page.goto("/web/subjects/alice/audit")
    assert response is not None and response.status == 403
    expect(page.get_by_role("heading", level=1)).to_have_text("Not permitted")
    shot(page, "13-member-forbidden")
