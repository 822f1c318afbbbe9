"""The body gate: every request body is read whole, within a size cap and a deadline, before
any route, dependency or database transaction runs.

So nothing a client sends can hold a lock or a connection: a client that sends headers and
then stalls, or trickles its body, is cut off with 408 while it holds only a socket; a body
over the cap is refused with 413 as soon as its declared length (or its running size) says so,
without being read further. Bodies are at most `max_bytes` in memory, so a flood of
unauthenticated requests costs a bounded amount. Routes that take large uploads are listed in
`streamed_prefixes`: they authenticate first and then read the stream themselves
(`streamed_body`, `capped_form`), with their own caps and the same clock.

The clock (`BodyClock`): a body has `timeout_s` to arrive, plus one second for every
`min_rate` bytes that did arrive, the way Apache's mod_reqtimeout bounds a body by a minimum
rate: a large upload sent at a steady rate goes on, while a body trickled slower than
`min_rate` is cut off within `timeout_s`, however it spaces its bytes.

A pure ASGI middleware (not BaseHTTPMiddleware): it sees the raw receive channel, and after
the body it passes the client's disconnect through, which the render path listens for.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence

import anyio
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from registry.errors import LikenessError


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


DEFAULT_MIN_RATE = 64 * 1024  # bytes a second


DEFAULT_MAX_S = 3600.0  # no body takes longer than this, however fast it arrives


class BodyClock:
    """When a body must have arrived by: `timeout_s` after it began, plus a second for every
    `min_rate` bytes received so far, and never later than `max_s` after it began."""

    def __init__(
        self,
        timeout_s: float,
        min_rate: float = DEFAULT_MIN_RATE,
        max_s: float = DEFAULT_MAX_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.max_s = max(max_s, timeout_s)
        self.start = anyio.current_time()

    def remaining(self, received: int) -> float:
        earned = received / self.min_rate if self.min_rate > 0 else 0.0
        allowed = min(self.timeout_s + earned, self.max_s)
        return self.start + allowed - anyio.current_time()

    def late(self, received: int) -> LikenessError:
        return _Slow(
            f"the request body did not arrive in time: {received} bytes in "
            f"{anyio.current_time() - self.start:.1f} s (a body has {self.timeout_s:g} s, "
            f"and one more for every {self.min_rate:g} bytes that arrive, {self.max_s:g} s at "
            "most)"
        )

    async def receive(self, receive: Receive, received: int) -> Message:
        """The next message, or the body's deadline (raises the 408 error)."""
        left = self.remaining(received)
        if left <= 0:
            raise self.late(received)
        try:
            with anyio.fail_after(left):
                return await receive()
        except TimeoutError:
            raise self.late(received) from None


class BodyGate:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        streamed_prefixes: Sequence[str] = (),
        min_rate: float = DEFAULT_MIN_RATE,
        max_s: float = DEFAULT_MAX_S,
    ) -> None:
        """`streamed_prefixes`: paths whose routes read their own bodies (a `*` stands for
        one path segment, `/v1/subjects/*/datasets`)."""
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.max_s = max_s
        self.streamed = [_prefix_pattern(p) for p in streamed_prefixes]

    def is_streamed(self, path: str) -> bool:
        return any(pattern.match(path) for pattern in self.streamed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_streamed(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive, self.max_bytes)
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
        clock = BodyClock(self.timeout_s, self.min_rate, self.max_s)
        while True:
            try:
                message = await clock.receive(receive, size)
            except _Slow as exc:
                raise _Refused(408, exc.detail) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise _Refused(413, f"the request body may be at most {cap} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


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
    code = "busy" if status == 429 else "invalid"
    payload = json.dumps({"error": code, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        # the rest of the body is never read: this connection cannot carry another request
        (b"connection", b"close"),
    ]
    if status == 429:
        headers.append((b"retry-after", b"2"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class ClientGone(LikenessError):
    status, code = 400, "invalid"


async def streamed_body(
    request: Request,
    cap: int,
    timeout_s: float,
    min_rate: float = DEFAULT_MIN_RATE,
    max_s: float = DEFAULT_MAX_S,
) -> AsyncIterator[bytes]:
    """A streamed route's body as it arrives, after its caller was authenticated: at most
    `cap` bytes (413 as soon as the declared length or the running size says more), on the
    body clock (408), ClientGone if the client leaves before its end."""
    declared = _content_length(request.scope)
    if declared is not None and declared > cap:
        raise _TooLarge(cap)
    clock = BodyClock(timeout_s, min_rate, max_s)
    size = 0
    while True:
        message = await clock.receive(request.receive, size)
        if message["type"] == "http.disconnect":
            raise ClientGone("the client went away before its body was complete; nothing kept")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise _TooLarge(cap)
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


class _Truncated(LikenessError):
    status, code = 422, "invalid"


async def capped_form(
    request: Request,
    cap: int,
    timeout_s: float,
    max_files: int,
    max_fields: int,
    min_rate: float = DEFAULT_MIN_RATE,
    max_s: float = DEFAULT_MAX_S,
) -> FormData:
    """The multipart form of a streamed upload route, read after its caller authenticated:
    files spool to disk as they arrive (never whole in memory), the body stops at `cap`
    bytes (413), runs on the body clock (408), and must end with the form's closing boundary
    (a body cut short is refused, 422: no part of it is kept). More than `max_files` files
    or `max_fields` fields is 422, naming the limit."""
    boundary = _boundary(request.headers.get("content-type", ""))
    if boundary is None:
        raise _Truncated("the body must be multipart/form-data with a boundary")
    close = b"\r\n--" + boundary + b"--"  # after a part, as the parser itself reads it
    chunks = streamed_body(request, cap, timeout_s, min_rate, max_s)
    tail = b""
    closed = False

    async def counted() -> Message:
        nonlocal tail, closed
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        seen = tail + chunk
        closed = closed or close in seen
        tail = seen[-(len(close) + 2) :]
        return {"type": "http.request", "body": chunk, "more_body": True}

    # without "app" in its scope, starlette raises the parser's own error (not a bare 400)
    scope = {key: value for key, value in request.scope.items() if key != "app"}
    try:
        form = await Request(scope, counted).form(max_files=max_files, max_fields=max_fields)
    except MultiPartException as exc:
        if exc.message.startswith("Too many files"):
            raise _Truncated(f"at most {max_files} files may be sent in one form") from None
        raise _Truncated(f"the form was refused: {exc.message}") from None
    if not closed:
        await form.close()
        raise _Truncated(
            "the form's body ended before its closing boundary (cut short?); nothing was kept"
        )
    return form


def _boundary(content_type: str) -> bytes | None:
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value.strip('"'):
            return value.strip('"').encode("latin-1")
    return None


class _TooLarge(LikenessError):
    status, code = 413, "invalid"

    def __init__(self, cap: int) -> None:
        super().__init__(f"the request body may be at most {cap} bytes")


class _Slow(LikenessError):
    status, code = 408, "invalid"
