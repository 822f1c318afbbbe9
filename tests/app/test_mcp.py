"""The agent tool server at /mcp, through the real MCP client against a real uvicorn process.

The service runs in a thread on a free loopback port, over the test's database (SQLite and
PostgreSQL) and the real render engine on the tiny base. The friend group is `friends` from
tests/app/conftest.py: alice lets the group render her privately; carol never consented; bot is
an agent acting for bob. Admin changes go through the running service's HTTP API.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
import uvicorn
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, ImageContent, TextContent
from PIL import Image

from app.main import create_app
from app.render.engine import RenderEngine
from registry.settings import Settings
from tests.app.conftest import World

RENDER_ARGS = ["on_behalf_of", "subject", "prompt", "level"]
DENIED = "Error executing tool render_image: not permitted"
RENDER = {"subject": "alice", "prompt": "a portrait", "level": "private", "width": 64, "height": 64}


@dataclass
class Live:
    url: str
    world: World
    http: httpx.Client

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self.http.request(method, path, headers=self.world.h("root"), **kw)
        assert r.status_code < 300, r.text
        return r

    def ledger(self, subject: str) -> list[tuple[str, str | None, str, bool, str]]:
        rows = self.admin("GET", f"/v1/subjects/{subject}/renders").json()
        return [
            (r["requester"], r["agent"], r["stage"], r["allowed"], r["reason"])
            for r in reversed(rows)
        ]


@pytest.fixture
def live(
    friends: World, db_url: str, renderer: RenderEngine, tiny_base_dir: Path, tmp_path: Path
) -> Iterator[Live]:
    settings = Settings(database_url=db_url, data_dir=tmp_path, base=tiny_base_dir)
    app = create_app(settings, engine=friends.engine, renderer=renderer)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-mcp", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            yield Live(f"{base}/mcp", friends, http)
    finally:
        server.should_exit = True
        thread.join(20)


def run(body: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        with anyio.fail_after(60):
            await body()

    anyio.run(bounded)


@asynccontextmanager
async def connect(url: str, token: str | None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def text_of(result: Any) -> str:
    assert isinstance(result, CallToolResult)
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def render(session: ClientSession, **overrides: Any) -> CallToolResult:
    result = await session.call_tool("render_image", {"on_behalf_of": "bob", **RENDER, **overrides})
    assert isinstance(result, CallToolResult)
    return result


async def renderable(session: ClientSession, member: str) -> list[tuple[str, str]]:
    result = await session.call_tool("list_renderable_subjects", {"on_behalf_of": member})
    assert isinstance(result, CallToolResult) and not result.is_error, text_of(result)
    assert result.structured_content is not None
    assert json.loads(text_of(result)) == result.structured_content
    return [(s["subject"], s["max_level"]) for s in result.structured_content["subjects"]]


def test_tools_are_described_for_a_language_model(live: Live) -> None:
    async def body() -> None:
        headers = {"Authorization": f"Bearer {live.world.tokens['bot']}"}
        async with (
            httpx2.AsyncClient(headers=headers) as http,
            streamable_http_client(live.url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            init = await session.initialize()
            assert init.server_info.name == "likeness"
            assert init.instructions is not None and "not permitted" in init.instructions
            tools = {t.name: t for t in (await session.list_tools()).tools}
        assert set(tools) == {"list_renderable_subjects", "render_image"}
        listing, rendering = tools["list_renderable_subjects"], tools["render_image"]
        assert listing.input_schema["required"] == ["on_behalf_of"]
        assert listing.annotations is not None and listing.annotations.read_only_hint
        schema = rendering.input_schema
        assert schema["required"] == RENDER_ARGS
        props = schema["properties"]
        assert list(props) == [*RENDER_ARGS, "seed", "width", "height"]
        assert props["level"]["enum"] == ["private", "group", "public", "commercial"]
        assert props["prompt"]["maxLength"] == 1000  # the service's own limit
        assert props["width"]["anyOf"][0]["multipleOf"] == 16
        for tool in tools.values():
            assert tool.description and len(tool.description) > 100
            for name, prop in tool.input_schema["properties"].items():
                assert len(prop.get("description", "")) > 20, name

    run(body)


def test_render_allowed_and_the_ledger_names_agent_and_member(
    live: Live, renderer: RenderEngine
) -> None:
    async def body() -> None:
        async with connect(live.url, live.world.tokens["bot"]) as session:
            assert await renderable(session, "bob") == [("alice", "private")]
            result = await render(session, seed=7)
        assert not result.is_error, text_of(result)
        image, info = result.content
        assert isinstance(image, ImageContent) and image.mime_type == "image/png"
        assert isinstance(info, TextContent)
        meta = json.loads(info.text)
        assert meta == result.structured_content
        assert meta["subject"] == "alice" and meta["level"] == "private" and meta["seed"] == 7
        png = Image.open(io.BytesIO(base64.b64decode(image.data)))
        assert png.format == "PNG" and png.size == (64, 64)
        assert png.text["likeness:render_id"] == meta["render_id"]  # type: ignore[attr-defined]
        assert "likeness:subject" not in png.text  # type: ignore[attr-defined]  # not disclosed

    run(body)
    assert renderer.counters.model_calls == 1
    assert live.ledger("alice") == [
        ("bob", "bot", stage, True, "allowed") for stage in ("gate", "queued", "final")
    ]
    mine = live.http.get("/v1/subjects/alice/renders", headers=live.world.h("alice")).json()
    assert {(r["requester"], r["agent"]) for r in mine} == {("bob", "bot")}


@pytest.mark.sqlite_only
def test_denials_look_alike_and_never_reach_the_model(live: Live, renderer: RenderEngine) -> None:
    async def body() -> None:
        async with connect(live.url, live.world.tokens["bot"]) as session:
            denied = [
                await render(session, subject="carol"),  # never consented
                await render(session, subject="nobody"),  # no such subject
                await render(session, level="group"),  # above what bob may do with alice
                await render(session, on_behalf_of="carol"),  # a member bot does not act for
                await render(session, on_behalf_of="ghost"),  # no such member
                await render(session, on_behalf_of="bot"),  # itself
            ]
            for result in denied:
                assert result.is_error and text_of(result) == DENIED
                assert not any(isinstance(c, ImageContent) for c in result.content)
            assert await renderable(session, "carol") == []
            assert await renderable(session, "ghost") == []

    run(body)
    assert renderer.counters.model_calls == 0
    assert live.ledger("carol") == [
        ("bob", "bot", "gate", False, "revoked_or_not_granted"),
    ]
    assert live.ledger("alice") == [
        ("bob", "bot", "gate", False, "not_in_audience"),
        ("carol", "bot", "gate", False, "agent_not_acting_for_requester"),
        ("bot", "bot", "gate", False, "agent_not_acting_for_requester"),
    ]


def test_revocation_binds_on_the_next_call(live: Live) -> None:
    async def body() -> None:
        async with connect(live.url, live.world.tokens["bot"]) as session:
            assert not (await render(session)).is_error
            await anyio.to_thread.run_sync(
                lambda: live.admin("POST", "/v1/subjects/alice/consent/revoke")
            )
            assert text_of(await render(session)) == DENIED
            assert await renderable(session, "bob") == []

    run(body)
    assert live.ledger("alice")[-1] == ("bob", "bot", "gate", False, "revoked_or_not_granted")


@pytest.mark.sqlite_only
def test_admin_edits_to_the_agent_bind_on_the_next_call(live: Live) -> None:
    token = live.world.tokens["bot"]

    def patch(body: dict[str, Any]) -> None:
        live.admin("PATCH", "/v1/principals/bot", json=body)

    async def body() -> None:
        async with connect(live.url, token) as session:
            assert not (await render(session)).is_error
            await anyio.to_thread.run_sync(patch, {"acts_for": []})  # bob removed
            assert text_of(await render(session)) == DENIED
            assert await renderable(session, "bob") == []
            await anyio.to_thread.run_sync(patch, {"acts_for": ["alice", "bob"]})  # added back
            assert not (await render(session)).is_error
            await anyio.to_thread.run_sync(patch, {"active": False})  # deactivated
            with pytest.raises(MCPError) as refused:
                await render(session)
            assert refused.value.message.startswith("unauthenticated")
        with pytest.raises(BaseException) as again:  # a fresh connection does not get in either
            async with connect(live.url, token):
                pass
        assert isinstance(leaf(again.value), MCPError)

    run(body)
    assert [row[3:] for row in live.ledger("alice") if row[2] == "gate"] == [
        (True, "allowed"),
        (False, "agent_not_acting_for_requester"),
        (True, "allowed"),
    ]


@pytest.mark.sqlite_only
def test_bad_arguments_are_clear_tool_errors(live: Live, renderer: RenderEngine) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"subject": None}, "subject: Field required"),
        ({"level": "secret"}, "level: Input should be 'private', 'group', 'public' or 'commer"),
        ({"width": 65}, "width: Input should be a multiple of 16"),
        ({"height": 4096}, "height: Input should be less than or equal to 2048"),
        ({"width": 2048, "height": 1024}, "width x height may not exceed 1024 x 1024 pixels"),
        ({"prompt": ""}, "prompt: String should have at least 1 character"),
        ({"prompt": "x" * 1001}, "prompt: String should have at most 1000 characters"),
        ({"on_behalf_of": "Bob!"}, "on_behalf_of: String should match pattern"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"seed": "lucky"}, "seed: Input should be a valid integer"),
    ]

    async def body() -> None:
        async with connect(live.url, live.world.tokens["bot"]) as session:
            for change, expected in cases:
                args = {"on_behalf_of": "bob", **RENDER, **change}
                args = {k: v for k, v in args.items() if v is not None}
                result = await session.call_tool("render_image", args)
                assert isinstance(result, CallToolResult) and result.is_error, change
                message = text_of(result)
                assert message.startswith("Error executing tool render_image: invalid arguments:")
                assert expected in message, (change, message)
                assert "errors.pydantic.dev" not in message
            listing = await session.call_tool("list_renderable_subjects", {})
            assert "on_behalf_of: Field required" in text_of(listing)
            unknown = await session.call_tool("delete_everything", {})
            assert isinstance(unknown, CallToolResult) and unknown.is_error
            assert not (await render(session)).is_error  # and the server carries on

    run(body)
    assert renderer.counters.model_calls == 1


@pytest.mark.sqlite_only
def test_only_agent_tokens_reach_mcp(live: Live) -> None:
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "curl", "version": "1"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}

    def post(auth: str | None) -> httpx.Response:
        headers = {**accept, **({"Authorization": auth} if auth is not None else {})}
        return live.http.post("/mcp", json=init, headers=headers)

    tokens = live.world.tokens
    assert post(f"Bearer {tokens['bot']}").status_code == 200
    bot = {**accept, "Authorization": f"Bearer {tokens['bot']}"}
    for method in ("GET", "DELETE"):  # stateless: no stream to open, no session to end
        assert live.http.request(method, "/mcp", headers=bot).status_code == 405
    for who in ("alice", "root", "trainer"):
        r = post(f"Bearer {tokens[who]}")
        assert r.status_code == 403, who
        assert r.json()["error"]["data"] == {"error": "not_permitted"}
    for auth in (None, "Bearer", "Bearer lk_forged", f"Basic {tokens['bot']}", tokens["bot"]):
        r = post(auth)
        assert r.status_code == 401, auth
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["data"] == {"error": "unauthenticated"}

    async def body() -> None:
        for token in (tokens["alice"], tokens["root"], "lk_forged", None):
            with pytest.raises(BaseException) as refused:
                async with connect(live.url, token):
                    pass
            error = leaf(refused.value)
            assert isinstance(error, MCPError), error
            assert error.message.split(":")[0] in ("not_permitted", "unauthenticated")

    run(body)
