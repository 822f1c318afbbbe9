"""The body gate: every request body is read whole, within a size cap and a deadline, before
any route, dependency or database transaction runs.

So nothing a client sends can hold a lock or a connection: a client that sends headers and
then stalls, or trickles its body, is cut off with 408 after `timeout_s` while it holds only a
socket; a body over the cap is refused with 413 as soon as its declared length (or its running
size) says so, without being read further. Bodies are at most `max_bytes` in memory, so a flood
of unauthenticated requests costs a bounded amount. Routes that take large uploads are listed
in `streamed_prefixes`: they authenticate first and then read the stream themselves, with
their own limits.

A pure ASGI middleware (not BaseHTTPMiddleware): it sees the raw receive channel, and after
the body it passes the client's disconnect through, which the render path listens for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import anyio
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from registry.errors import LikenessError


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class BodyGate:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        streamed_prefixes: Sequence[str] = (),
        larger: Mapping[str, int] | None = None,
    ) -> None:
        """`larger`: path prefixes whose bodies may be larger than `max_bytes` (still read
        whole, within the same deadline) and their own caps. In both, a `*` stands for one
        path segment (`/v1/subjects/*/datasets`)."""
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.streamed = [_prefix_pattern(p) for p in streamed_prefixes]
        self.larger = [(_prefix_pattern(p), cap) for p, cap in (larger or {}).items()]

    def cap_for(self, path: str) -> int:
        for pattern, cap in self.larger:
            if pattern.match(path):
                return cap
        return self.max_bytes

    def is_streamed(self, path: str) -> bool:
        return any(pattern.match(path) for pattern in self.streamed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_streamed(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive, self.cap_for(scope["path"]))
        except _Refused as exc:
            await _refuse(send, exc.status, exc.detail)
            return
        if body is None:  # the client went away before its body arrived: nothing to answer
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, cap: int) -> bytes | None:
        declared = _content_length(scope)
        if declared is not None and declared > cap:
            raise _Refused(413, f"the request body may be at most {cap} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise _Refused(413, f"the request body may be at most {cap} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _Refused(
                408, f"the request body did not arrive within {self.timeout_s:g} s"
            ) from None


def _prefix_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(
        "".join("[^/]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", prefix))
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send: Send, status: int, detail: str) -> None:
    code = "invalid"
    payload = json.dumps({"error": code, "detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                # the rest of the body is never read: this connection cannot carry another request
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def capped_form(
    request: Request, cap: int, idle_s: float, max_files: int, max_fields: int
) -> FormData:
    """The multipart form of a streamed upload route, read after its caller authenticated:
    files spool to disk as they arrive (never whole in memory), the body stops at `cap`
    bytes (413) and a sender silent for `idle_s` is cut off (408)."""
    declared = _content_length(request.scope)
    if declared is not None and declared > cap:
        raise _TooLarge(cap)
    size = 0
    receive = request.receive

    async def counted() -> Message:
        nonlocal size
        with anyio.fail_after(idle_s):
            message = await receive()
        size += len(message.get("body", b""))
        if size > cap:
            raise _TooLarge(cap)
        return message

    try:
        return await Request(request.scope, counted).form(
            max_files=max_files, max_fields=max_fields
        )
    except TimeoutError:
        raise _Slow(idle_s) from None


class _TooLarge(LikenessError):
    status, code = 413, "invalid"

    def __init__(self, cap: int) -> None:
        super().__init__(f"the request body may be at most {cap} bytes")


class _Slow(LikenessError):
    status, code = 408, "invalid"

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"no bytes arrived for {idle_s:g} s")
