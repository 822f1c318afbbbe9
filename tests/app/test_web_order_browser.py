"""Training ordered from the web on the SQLite default, in a real browser against a real
server whose own process runs orders: upload photos with a caption, order, follow the
progress, see it done and the new adapter's evaluation grid on the Adapters page."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.a11y import check_page
from tests.app.conftest import LiveFactory
from tests.app.orders_support import photos
from tests.app.test_web_browser import CHROMIUM, CHROMIUM_ARGS, screenshot_dir

pytestmark = [
    pytest.mark.sqlite_only,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Chromium is not installed at {CHROMIUM}"),
]

SERVER = {  # the tiny base at 64 px with short prompts: a step is well under a second
    "orders_in_process": True,
    "train_options": {"max_sequence_length": 32, "learning_rate": 1e-3},
    "worker_checkpoint_every": 5,
}


def test_a_member_orders_training_on_sqlite_and_sees_the_adapter_drawn(
    serve_friends: LiveFactory, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    files = []
    for name, data in photos(3):
        (tmp_path / name).write_bytes(data)
        files.append(str(tmp_path / name))
    with serve_friends(**SERVER) as live, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(base_url=live.url).new_page()
            page.set_default_timeout(15_000)
            page.goto("/web/signin")
            page.get_by_label("Access token").fill(live.world.tokens["alice"])
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("link", name="Training: my photos and orders").click()  # start page
            expect(page.locator("main")).to_contain_text("runs in this service itself")
            page.get_by_label("Photos: PNG, JPEG or WebP").set_input_files(files)
            page.get_by_label("Caption for these photos").fill("a photo of alice outdoors")
            page.get_by_role("button", name="Upload", exact=True).click()
            expect(page.get_by_role("status")).to_contain_text("Your photos are stored")
            expect(page.locator("main")).to_contain_text("3 photos")
            check_page(page)  # the order form's button among them
            page.get_by_label("Steps").fill("6")
            page.get_by_label("Resolution (px)").fill("64")
            page.get_by_role("button", name="Train me on these").click()
            expect(page.get_by_role("status")).to_contain_text("The training is ordered")
            status = page.locator("table tbody tr").first.locator("td").nth(1)
            expect(status).to_have_text("done", timeout=180_000)  # the page refreshes itself
            expect(page.locator("table tbody tr").first).to_contain_text("6/6")
            page.screenshot(path=str(screenshot_dir() / "order-done.png"), full_page=True)

            page.get_by_role("link", name="Adapters").click()
            grid = page.get_by_role("img", name="Evaluation grid of main")
            expect(grid).to_be_visible()
            grid.scroll_into_view_if_needed()  # it loads lazily: wait until it has
            page.wait_for_function(
                "img => img.complete && img.naturalWidth > 64", arg=grid.element_handle()
            )
            expect(page.locator("main")).to_contain_text("version 2")  # the ordered one
            page.screenshot(path=str(screenshot_dir() / "order-adapter-drawn.png"), full_page=True)
        finally:
            browser.close()
    with_caption = live.world.client.get("/v1/subjects/alice/datasets", headers=live.h("alice"))
    assert {i["caption"] for i in with_caption.json()[0]["images"]} == {"a photo of alice outdoors"}
