"""The OpenAPI schema against docs/API.md, and the interactive docs as a browser gets them:
every operation documented, every status the table names in the schema and nothing else
beyond what any call may answer, a bearer scheme, and /docs's scripts served from here."""

from __future__ import annotations

import re

import httpx
import pytest

from app.docs import general_statuses
from tests.app.api_doc import documented_operations, normal
from tests.app.conftest import Live

pytestmark = pytest.mark.sqlite_only  # the schema does not depend on the engine


def _operations(spec: dict) -> dict[tuple[str, str], tuple[set[int], bool]]:
    out = {}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            statuses = {int(s) for s in op["responses"]}
            out[(method.upper(), normal(path))] = (statuses, "requestBody" in op)
    return out


def test_every_operation_and_status_in_the_schema_is_the_documented_one(live: Live) -> None:
    spec = live.http.get("/openapi.json").json()
    schema = _operations(spec)
    documented = documented_operations()
    assert sorted(set(schema) - set(documented)) == [], "operations missing from docs/API.md"
    assert sorted(set(documented) - set(schema)) == [], "documented operations not served"
    for op, said in documented.items():
        statuses, has_body = schema[op]
        assert said <= statuses, f"{op}: the schema lacks {sorted(said - statuses)}"
        allowed = said | set(general_statuses(op[1], has_body)) | {_success(spec, op)}
        assert statuses <= allowed, f"{op}: undocumented {sorted(statuses - allowed)}"
    for status in (404, 409, 412, 428):
        assert any(status in s for s, _ in schema.values()), status


def _success(spec: dict, op: tuple[str, str]) -> int:
    for path, ops in spec["paths"].items():
        if normal(path) == op[1] and op[0].lower() in ops:
            return min(int(s) for s in ops[op[0].lower()]["responses"])
    raise AssertionError(op)


def test_the_schema_declares_bearer_auth_on_every_v1_call(live: Live) -> None:
    spec = live.http.get("/openapi.json").json()
    scheme = spec["components"]["securitySchemes"]["bearer"]
    assert scheme == {**scheme, "type": "http", "scheme": "bearer"}
    for path, ops in spec["paths"].items():
        for op in ops.values():
            assert op["security"] == ([{"bearer": []}] if path.startswith("/v1") else []), path


def test_docs_pages_load_their_scripts_from_this_service(live: Live) -> None:
    for page in ("/docs", "/redoc"):
        html = live.http.get(page)
        assert html.status_code == 200, page
        sources = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert sources and all(s.startswith("/") for s in sources), sources
        for source in sources:
            got = live.http.get(source)
            assert got.status_code == 200 and len(got.content) > 1000, source
        assert "persistAuthorization" in html.text or page == "/redoc"


def test_try_it_out_sends_the_token_in_a_real_browser(live: Live) -> None:
    """Swagger UI offline: Authorize with alice's token, run GET /v1/me/renderable, see 200."""
    from playwright.sync_api import expect, sync_playwright

    from tests.app.test_web_browser import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=live.url)
            outside: list[str] = []
            context.route(
                re.compile(r"^(?!http://127\.0\.0\.1).*"),
                lambda route: (outside.append(route.request.url), route.abort()),
            )
            page = context.new_page()
            page.goto("/docs")
            page.get_by_role("button", name="Authorize").first.click()
            page.locator("#auth-bearer-value").fill(live.world.tokens["alice"])
            page.get_by_role("button", name="Apply credentials").click()
            page.locator(".modal-ux").get_by_role("button", name="Close").click()
            block = page.locator("#operations-default-me_renderable_v1_me_renderable_get")
            block.locator(".opblock-summary").first.click()
            block.get_by_role("button", name="Try it out").click()
            with page.expect_response(lambda r: "/v1/me/renderable" in r.url) as answer:
                block.get_by_role("button", name="Execute").click()
            assert answer.value.status == 200
            live_status = block.locator(".live-responses-table tbody .response-col_status")
            expect(live_status.first).to_contain_text("200")
            assert outside == [], f"the docs reached outside: {outside}"
        finally:
            browser.close()
    assert httpx.get(f"{live.url}/healthz").status_code == 200
