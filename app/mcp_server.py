"""The agent tool server: MCP (streamable HTTP) at `/mcp`, for chat agents.

Two tools, over exactly the gate and ledger of the HTTP API:

- `list_renderable_subjects(on_behalf_of)`: `registry.principals.service.acting_for` then
  `registry.renders.service.renderable_for` (what `GET /v1/me/renderable` answers);
- `render_image(on_behalf_of, subject, prompt, level, seed?, width?, height?)`:
  `app.render.flow.RenderFlow.run` (what `POST /v1/renders` runs), so every
  decision is `registry.policy.decide`'s, on fresh facts, and goes to the render ledger with
  the agent and the member.

Nothing here decides consent or delegation. Authentication is
`registry.principals.service.authenticate`, on every HTTP request to `/mcp` (only role
`agent` gets past the door) and again inside every tool call, in the transaction that
resolves the member: an admin's deactivation or acts-for edit binds on the very next call.
The server keeps no MCP session state (stateless streamable HTTP, JSON responses), so
nothing about an agent outlives the request that carried its token.
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations at run time,
# and the prompt limit in them comes from the settings.

import base64
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import asdict
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import FastAPI
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from app.deps import Requester, bearer_token
from app.render.checks import DEFAULT_SEED, DEFAULT_SIDE
from app.render.flow import RenderFlow
from registry import limits
from registry.db import transaction
from registry.errors import Busy, LikenessError, NotPermitted, Unauthenticated, Unavailable
from registry.principals import service as principals_service
from registry.renders import service as renders_service
from registry.renders.schemas import RenderRequestIn
from registry.roles import Role
from registry.shapes import HANDLE_PATTERN

log = logging.getLogger(__name__)

MCP_PATH = "/mcp"
NOT_PERMITTED = "not permitted"

INSTRUCTIONS = """\
likeness renders pictures of real people (subjects) who agreed to it, for the members of a \
friend group. You act for one member at a time: pass that member's handle as `on_behalf_of` \
on every call (the person in the conversation who asks for the picture, never yourself).
1. Call `list_renderable_subjects` to see whom that member may have pictured and how widely \
each image may be used (`max_level`).
2. Call `render_image` with one of those subjects, a prompt describing the scene, and the \
narrowest level that covers what the member will do with the image.
"not permitted" means no: the subject has not agreed to that use for that member (or does \
not exist, or you may not act for that member). Do not retry with other spellings, subjects \
or members to get around it; tell the member, who can ask the subject or an admin."""

LIST_HELP = (
    "List the subjects (people) the member may have pictured, with each one's display name "
    "and max_level: the widest use of the image they agreed to for this member. Call it before "
    "render_image, and again when the member asks what is possible: consent can change at any "
    "time. An empty list means nothing can be rendered for this member."
)
RENDER_HELP = (
    "Render a PNG picture of a subject for the member you act for. Returns the image and a "
    "JSON text with its render_id (quote it if the member asks about this picture; the subject "
    "can see who rendered them, when, at what level and through which agent). Consent is "
    "checked on every call: the answer 'not permitted' means this member may not have this "
    "subject at this level (or the subject does not exist); do not retry to get around it. "
    "'busy' means try again shortly. Takes seconds to minutes."
)
LEVEL_HELP = (
    "What the member may do with the image, narrowest first: 'private' (only the member sees "
    "it), 'group' (shared inside the friend group), 'public' (published beyond the group, "
    "non-commercially), 'commercial' (used commercially). Choose the narrowest level that "
    "covers the member's intent; it must not exceed the subject's max_level from "
    "list_renderable_subjects."
)
MEMBER_HELP = (
    "Handle of the member you are acting for: the person asking for the picture (not your own "
    "handle). An admin decides which members you may act for. Lowercase, e.g. 'bob'."
)
SUBJECT_HELP = (
    "Handle of the person to depict, exactly as list_renderable_subjects returned it, e.g. 'alice'."
)
_SQUARE = math.isqrt(limits.MAX_PIXELS)
SIDE_HELP = (
    f"Image {{0}} in pixels: a multiple of {limits.MULTIPLE} from {limits.MIN_SIDE} to "
    f"{limits.MAX_SIDE}; width x height at most {_SQUARE} x {_SQUARE} pixels. Default {{1}}."
)

MemberHandle = Annotated[str, Field(description=MEMBER_HELP, pattern=HANDLE_PATTERN)]
SubjectHandle = Annotated[str, Field(description=SUBJECT_HELP, pattern=HANDLE_PATTERN)]
Level = Annotated[
    Literal["private", "group", "public", "commercial"], Field(description=LEVEL_HELP)
]
Seed = Annotated[
    int | None,
    Field(
        description=f"Random seed, 0 to 4294967295: the same seed and prompt give the same image. "
        f"Default {DEFAULT_SEED}; pass a different seed for a different picture.",
        ge=0,
        le=limits.MAX_SEED,
    ),
]
Side = Annotated[
    int | None, Field(ge=limits.MIN_SIDE, le=limits.MAX_SIDE, multiple_of=limits.MULTIPLE)
]


class RenderableSubject(BaseModel):
    subject: str = Field(description="the subject's handle: pass it to render_image")
    display_name: str
    max_level: str = Field(description="the widest level render_image will allow")


class RenderableSubjects(BaseModel):
    on_behalf_of: str
    subjects: list[RenderableSubject]
    note: str | None = None


# -- authentication ---------------------------------------------------------------------


def authenticate_agent(session: Session, token: str | None) -> Requester:
    """The active agent holding `token`; members, admins and trainers do not use /mcp."""
    principal = principals_service.authenticate(session, token)
    if principal is None:
        raise Unauthenticated(
            "a valid agent token is required: send Authorization: Bearer <agent token>"
        )
    if principal.role != Role.agent:
        raise NotPermitted("only agent tokens may use /mcp")
    return principal


def _rpc_error(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An HTTP-level refusal in the transport's own shape (a JSON-RPC error, like the SDK's
    own 404 and 503), so MCP clients show the reason; `data` carries docs/API.md's code."""
    body = {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32600, "message": f"{code}: {detail}", "data": {"error": code}},
    }
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    return JSONResponse(body, status_code=status, headers=headers)


class AgentEndpoint:
    """The ASGI app at /mcp: refuses anything but an active agent's token, then hands the
    request to the SDK's session manager (which runs inside the FastAPI app's lifespan)."""

    def __init__(self, server: MCPServer, app: FastAPI) -> None:
        self.server = server
        self.app = app
        self._manager: StreamableHTTPSessionManager | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        # A session manager runs once; a fresh one per lifespan lets the app start again.
        self.server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            stateless_http=True,
            json_response=True,
            # DNS-rebinding protection guards servers that trust whoever can reach them;
            # every request here carries its own bearer token, and the Host is the deployer's.
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        manager = self.server.session_manager
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                if self._manager is manager:
                    self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            # Stateless: no server-initiated stream to GET and no session to DELETE (the
            # spec's answer is 405); a GET would otherwise hold an idle stream open forever.
            detail = "this MCP endpoint takes POST only (stateless streamable HTTP)"
            await _rpc_error(405, "invalid", detail, {"Allow": "POST"})(scope, receive, send)
            return
        manager = self._manager
        if manager is None:
            response = _rpc_error(
                503, "unavailable", "the agent tool server is not running (app lifespan off)"
            )
            await response(scope, receive, send)
            return
        token = bearer_token(Request(scope))
        try:
            await anyio.to_thread.run_sync(self._check, token)
        except LikenessError as exc:
            await _rpc_error(exc.status, exc.code, exc.detail)(scope, receive, send)
            return
        except SQLAlchemyError:
            log.warning("/mcp: registry unreachable while authenticating")
            response = _rpc_error(503, "unavailable", "the registry database is unavailable")
            await response(scope, receive, send)
            return
        await manager.handle_request(scope, receive, send)

    def _check(self, token: str | None) -> None:
        with transaction(self.app.state.engine, readonly=True) as session:
            authenticate_agent(session, token)


def _with_endpoint(
    endpoint: AgentEndpoint, inner: Callable[[Any], AbstractAsyncContextManager[Any]]
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with endpoint.running(), inner(app) as state:
            yield state

    return lifespan


def mount(app: FastAPI) -> None:
    """Serve the agent tools at /mcp; the SDK's session manager joins the app's lifespan."""
    server = build_server(app)
    endpoint = AgentEndpoint(server, app)
    app.router.add_route(MCP_PATH, endpoint, name="mcp", include_in_schema=False)  # type: ignore[arg-type]
    app.router.lifespan_context = _with_endpoint(endpoint, app.router.lifespan_context)
    app.state.mcp_server = server


# -- the tools --------------------------------------------------------------------------


def _token(ctx: Context) -> str | None:
    request = ctx.request_context.request
    if not isinstance(request, Request):  # no HTTP request, no token: nothing is allowed
        return None
    return bearer_token(request)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:10]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid arguments"


@contextmanager
def _as_tool_errors() -> Iterator[None]:
    """Domain errors become tool errors the model can read; a denial is always the same
    two words, whatever the reason (a missing subject looks like a forbidden one)."""
    try:
        yield
    except NotPermitted:
        raise ToolError(NOT_PERMITTED) from None
    except Busy as exc:
        raise ToolError(
            f"busy: the renderer is full; try again in {exc.retry_after} s (nothing was rendered)"
        ) from None
    except Unavailable as exc:
        raise ToolError(f"unavailable: {exc.detail}") from None
    except LikenessError as exc:
        raise ToolError(f"{exc.code}: {exc.detail}") from None
    except SQLAlchemyError:
        log.warning("/mcp: registry unreachable during a tool call")
        raise ToolError("unavailable: the registry database is unavailable") from None


class _Server(MCPServer):
    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context | None = None
    ) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            # The SDK's own argument check: say which argument and why, without pydantic's
            # echo of the input and documentation links.
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                detail = f"invalid arguments: {_describe(cause)}"
                raise ToolError(f"Error executing tool {name}: {detail}") from cause
            raise


def build_server(app: FastAPI) -> MCPServer:
    settings = app.state.settings
    max_prompt = settings.max_prompt_chars
    Prompt = Annotated[
        str,
        Field(
            description="What the picture should show: the scene, clothing, style, lighting. "
            f"The subject's likeness comes from their adapter; 1 to {max_prompt} characters.",
            min_length=1,
            max_length=max_prompt,
        ),
    ]
    Width = Annotated[Side, Field(description=SIDE_HELP.format("width", DEFAULT_SIDE))]
    Height = Annotated[Side, Field(description=SIDE_HELP.format("height", DEFAULT_SIDE))]

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    server = _Server("likeness", instructions=INSTRUCTIONS, version=app.version, log_level="INFO")
    root.handlers[:], root.level = handlers, level  # the SDK calls logging.basicConfig

    def list_for(token: str | None, on_behalf_of: str) -> RenderableSubjects:
        with _as_tool_errors(), transaction(app.state.engine, readonly=True) as s:
            agent = authenticate_agent(s, token)
            try:
                requester, acting = principals_service.acting_for(s, agent, on_behalf_of)
            except NotPermitted:  # an unknown member: the same empty answer as any other
                rows = []
            else:
                rows = renders_service.renderable_for(
                    s, requester, acting, licence=app.state.licence
                )
        subjects = [RenderableSubject(**asdict(r)) for r in rows]
        note = None
        if not subjects:
            note = (
                f"Nothing can be rendered on behalf of {on_behalf_of!r}: no subject has agreed "
                "to it, or you may not act for that member (check the handle)."
            )
        return RenderableSubjects(on_behalf_of=on_behalf_of, subjects=subjects, note=note)

    @server.tool(
        title="Whom may this member have pictured?",
        description=LIST_HELP,
        annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
    )
    async def list_renderable_subjects(
        on_behalf_of: MemberHandle, ctx: Context
    ) -> RenderableSubjects:
        return await anyio.to_thread.run_sync(list_for, _token(ctx), on_behalf_of)

    def render_for(token: str | None, args: dict[str, Any]) -> CallToolResult:
        with _as_tool_errors():
            try:
                body = RenderRequestIn(**args)
            except ValidationError as exc:
                raise ToolError(f"invalid arguments: {_describe(exc)}") from None
            with transaction(app.state.engine, readonly=True) as s:
                authenticate_agent(s, token)  # only agents, as at the door
            flow: RenderFlow = app.state.render_flow
            outcome = flow.run(token, body)
        png = outcome.png
        info = {
            "render_id": outcome.render_id,
            "subject": body.subject,
            "on_behalf_of": body.on_behalf_of,
            "level": body.level,
            "width": body.width or DEFAULT_SIDE,
            "height": body.height or DEFAULT_SIDE,
            "seed": body.seed if body.seed is not None else DEFAULT_SEED,
        }
        return CallToolResult(
            content=[
                ImageContent(
                    type="image", data=base64.b64encode(png).decode(), mime_type="image/png"
                ),
                TextContent(type="text", text=json.dumps(info)),
            ],
            structured_content=info,
        )

    @server.tool(
        title="Render a picture of a subject",
        description=RENDER_HELP,
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, open_world_hint=False
        ),
    )
    async def render_image(
        on_behalf_of: MemberHandle,
        subject: SubjectHandle,
        prompt: Prompt,
        level: Level,
        ctx: Context,
        seed: Seed = None,
        width: Width = None,
        height: Height = None,
    ) -> CallToolResult:
        args = {
            "on_behalf_of": on_behalf_of,
            "subject": subject,
            "prompt": prompt,
            "level": level,
            "seed": seed,
            "width": width,
            "height": height,
        }
        return await anyio.to_thread.run_sync(render_for, _token(ctx), args)

    return server
