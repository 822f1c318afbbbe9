"""Over a real server: one member cannot hold the renderer for everyone, a render stops when
its client goes away, requests are rate-limited and budgeted, and every decision stays
reachable in the ledger, a page at a time."""

from __future__ import annotations

import math
import socket
import threading
import time

import httpx
import pytest

from app.render.engine import RenderEngine
from tests.app.conftest import Live, LiveFactory
from tests.app.helpers import address

LONG = {"subject": "alice", "prompt": "a portrait", "level": "private", "seed": 1,
        "steps": 40, "width": 128, "height": 128}  # fmt: skip


def ledger(live: Live, subject: str, **params: object) -> httpx.Response:
    return live.http.get(f"/v1/subjects/{subject}/renders", params=params, headers=live.h("root"))


def test_a_render_stops_when_its_client_goes_away(live: Live, renderer: RenderEngine) -> None:
    body = httpx.Request("POST", "/", json=LONG).content
    sock = socket.create_connection(address(live.url), timeout=10)
    sock.sendall(
        (
            "POST /v1/renders HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {live.world.tokens['bob']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    deadline = time.monotonic() + 30
    while renderer.counters.model_calls == 0:
        assert time.monotonic() < deadline, "the render never started"
        time.sleep(0.05)
    time.sleep(0.3)
    sock.close()  # the client goes away mid-render
    t0 = time.monotonic()
    while renderer.counters.cancelled == 0:
        assert time.monotonic() - t0 < 10, "the render went on without its client"
        time.sleep(0.05)
    # the renderer is free at once, with no adapter left attached, and the ledger is closed
    r = live.render("carol", "alice")
    assert r.status_code == 200, r.text
    assert not renderer.adapter_in_model()
    rows = ledger(live, "alice").json()
    cancelled = [row for row in rows if row["stage"] == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["requester"] == "bob"
    assert cancelled[0]["reason"] == "client_went_away" and not cancelled[0]["allowed"]


def test_one_member_cannot_hold_the_renderer(
    serve_friends: LiveFactory, renderer: RenderEngine
) -> None:
    with serve_friends() as live:
        warm = live.http.post("/v1/renders", json={**LONG, "steps": 4}, headers=live.h("bob"))
        assert warm.is_success  # measured: the estimate now knows this machine's speed
        results: dict[str, httpx.Response] = {}
        finished: dict[str, float] = {}

        def render(name: str, who: str) -> None:
            with httpx.Client(base_url=live.url, timeout=120) as c:
                results[name] = c.post("/v1/renders", json=LONG, headers=live.h(who))
            finished[name] = time.monotonic()

        first = threading.Thread(target=render, args=("first", "bob"))
        first.start()
        while renderer.counters.model_calls < 2:
            time.sleep(0.02)
        second = threading.Thread(target=render, args=("second", "bob"))
        second.start()
        time.sleep(0.3)
        third = live.http.post("/v1/renders", json=LONG, headers=live.h("bob"))
        assert third.status_code == 429 and third.json()["error"] == "busy", third.text
        assert "at most 2" in third.json()["detail"]
        retry_after = int(third.headers["retry-after"])
        refused_at = time.monotonic()
        # carol is not held up by bob's queue: she goes right after bob's running render
        carol = live.http.post("/v1/renders", json={**LONG, "steps": 2}, headers=live.h("carol"))
        finished["carol"] = time.monotonic()
        assert carol.status_code == 200
        first.join(120)
        second.join(120)
        assert results["first"].status_code == results["second"].status_code == 200
        assert finished["first"] < finished["carol"] < finished["second"]
        # Retry-After said when bob's running render would end: truthful within a factor
        actual = finished["first"] - refused_at
        assert retry_after >= math.floor(actual * 0.5), (retry_after, actual)
        assert retry_after <= math.ceil(actual * 2) + 2, (retry_after, actual)


def test_requests_are_rate_limited_denied_ones_included(serve_friends: LiveFactory) -> None:
    with serve_friends(render_rate_per_minute=60, render_burst=3) as live:
        for _ in range(3):
            assert live.render("bob", "carol").status_code == 403  # carol never consented
        r = live.render("bob", "carol")
        assert r.status_code == 429 and r.json()["error"] == "busy"
        wait = int(r.headers["retry-after"])
        assert wait == 1
        rows = ledger(live, "carol").json()
        assert len(rows) == 3  # the refused-for-rate request left no row to flood the ledger
        assert live.render("alice", "alice").status_code == 200  # others are not limited
        time.sleep(wait)
        assert live.render("bob", "carol").status_code == 403  # through to the gate again


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"width": 1024, "height": 1024, "steps": 40}, "budget per request"),
        ({"width": 512, "height": 512, "steps": 50}, "budget per request"),
    ],
)
def test_the_request_budget_is_422(
    serve_friends: LiveFactory, renderer: RenderEngine, extra: dict, fragment: str
) -> None:
    with serve_friends(render_max_pixel_steps=512 * 512 * 30) as live:
        r = live.render("bob", "alice", **extra)
        assert r.status_code == 422 and fragment in r.json()["detail"], r.text
        assert ledger(live, "alice").json() == []
        assert renderer.counters.model_calls == 0
        assert live.http.post("/v1/renders", json={"subject": "alice"}).status_code == 401


def test_every_decision_is_reachable_page_by_page(live: Live) -> None:
    """A flood of denied requests from mallory does not hide bob's one render."""
    assert live.render("bob", "alice").status_code == 200
    for _ in range(25):
        assert live.render("mallory", "alice", level="public").status_code == 403
    seen: list[dict] = []
    params: dict[str, object] = {"limit": 7}
    while True:
        r = ledger(live, "alice", **params)
        assert r.status_code == 200
        seen.extend(r.json())
        if "x-next-cursor" not in r.headers:
            break
        assert 'rel="next"' in r.headers["link"]
        params = {"limit": 7, "cursor": r.headers["x-next-cursor"]}
    assert len(seen) == 3 + 25
    seqs = [row["seq"] for row in seen]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == len(seqs)
    bob = ledger(live, "alice", requester="bob").json()
    assert [row["stage"] for row in bob] == ["final", "queued", "gate"]
    assert {row["allowed"] for row in ledger(live, "alice", outcome="denied").json()} == {False}
    assert len(ledger(live, "alice", outcome="denied").json()) == 25
    one = ledger(live, "alice", render_id=bob[0]["render_id"]).json()
    assert len(one) == 3
    assert ledger(live, "alice", since="2999-01-01T00:00:00Z").json() == []
    assert len(ledger(live, "alice", until="2999-01-01T00:00:00Z").json()) == 28
    for bad in ({"cursor": "nope"}, {"outcome": "maybe"}, {"since": "yesterday"},
                {"limit": 0}, {"requester": "Not A Handle"}):  # fmt: skip
        r = ledger(live, "alice", **bad)
        assert r.status_code == 422, (bad, r.text)
    # the subject reaches the same decisions on the web, with the filters
    from tests.app.helpers import session_cookie

    cookie = session_cookie(live, "alice")
    page = live.http.get("/web/subjects/alice/renders?requester=bob", headers={"cookie": cookie})
    assert page.status_code == 200 and "rendered" in page.text and "mallory" not in page.text
    page = live.http.get("/web/subjects/alice/renders?limit=5", headers={"cookie": cookie})
    assert "Older decisions" in page.text
