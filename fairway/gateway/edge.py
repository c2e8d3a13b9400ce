"""The outermost middleware: refuses oversized headers and a URL holding a NUL character, answers
an error no handler knew with a 500 that closes the connection, puts the x-ratelimit-* headers on
every response to an authenticated request (those a route prepared from the limits it applied,
else the current state, read as the response starts), and runs per-request cleanups once the
response is over.

It also keeps its send in the request's state (BODY_SEND) for streamed body chunks.

Cleanups (releasing an admission slot, the active-stream gauge) run when the ASGI call returns:
after the last byte of a stream, after a client disconnect, after an error, even when a
streaming body never started. A finally inside the body generator would miss that last case.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fairway.gateway.errors import ApiError, unexpected

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024  # all request headers together (nginx's default large buffer is 8 KiB x 4)
MAX_HEADER_VALUE_BYTES = 8 * 1024  # any one header

Cleanup = Callable[[], Awaitable[None] | None]

# The send this middleware was given, kept in the request's state: a stream's body chunks may go
# straight to it (streaming.EventStream), since every send wrapper between it and the route (this
# middleware's, the body limit's, Starlette's exception handlers') acts on the response start only.
BODY_SEND = "body_send"


def set_ratelimit_headers(request: Request, headers: dict[str, str]) -> None:
    request.state.ratelimit_headers = headers


def add_cleanup(request: Request, cleanup: Cleanup) -> None:
    cleanups = getattr(request.state, "cleanups", None)
    if cleanups is None:
        cleanups = request.state.cleanups = []
    cleanups.append(cleanup)


def client_ip(request: Request) -> str:
    """The peer address. Behind a proxy, run uvicorn with --proxy-headers (and
    --forwarded-allow-ips) so this is the client's, from X-Forwarded-For."""
    return request.client.host if request.client else "unknown"


async def _current_headers(scope: Scope, state: dict[str, Any]) -> dict[str, str] | None:
    """The x-ratelimit-* headers of an authenticated request whose route set none (most routes,
    and errors before the limits were applied): read from the limits now."""
    principal = state["principal"]
    try:
        gw = scope["app"].state.gateway
        model = state.get("ratelimit_model") or gw.default_model
        return await gw.limits.headers(principal.user_id, model, principal.tier)
    except Exception:  # a response must not fail for want of its rate-limit headers
        log.warning("rate-limit headers unavailable", exc_info=True)
        return None


def _nul_in_url(scope: Scope) -> ApiError | None:
    """A 400 for a NUL character in the path (uvicorn has decoded it) or the query: no id or
    parameter holds one, and PostgreSQL cannot even compare one (it was a 500 there, a 404 on SQLite)."""
    query: bytes = scope.get("query_string") or b""
    if "\x00" in scope.get("path", ""):
        where, param = "path", None
    elif b"%00" in query:  # the only way to write a NUL in a query ('%' is always an escape's start)
        where = "query"
        param = next((name for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True)
                      if "\x00" in name or "\x00" in value), None)
    else:
        return None
    return ApiError(400, f"The request URL's {where} holds a NUL character (%00), which no id or parameter may "
                         "contain.", param=param, code="invalid_request")


def _repeated_query_param(scope: Scope) -> ApiError | None:
    """Every query parameter of this API takes one value: a repeated one (?from=a&from=b) is a 400
    naming it, rather than the last value taken in silence. (Here, not as the app's dependency:
    FastAPI solves an app-level dependency on every request, for a request that almost never has
    a query string at all: bench/README.md, gateway_requests.py.)"""
    query: bytes = scope.get("query_string") or b""
    if not query:
        return None
    seen: set[str] = set()
    for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return ApiError(400, f"Query parameter '{name}' is given more than once; give it once.", param=name,
                            code="invalid_value")
        seen.add(name)
    return None


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_header_value_bytes: int = MAX_HEADER_VALUE_BYTES) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_header_value_bytes = max_header_value_bytes

    def _check_headers(self, scope: Scope) -> ApiError | None:
        total = 0
        for name, value in scope.get("headers") or []:
            total += len(name) + len(value) + 4
            if len(value) > self.max_header_value_bytes:
                return ApiError(431, f"Request header {name.decode('latin-1')!r} is {len(value)} bytes; at most "
                                     f"{self.max_header_value_bytes} are allowed.", code="request_header_too_large")
        if total > self.max_header_bytes:
            return ApiError(431, f"Request headers are {total} bytes in all; at most {self.max_header_bytes} are "
                                 "allowed.", code="request_header_too_large")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_headers(scope) or _nul_in_url(scope) or _repeated_query_param(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        state[BODY_SEND] = send

        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = state.get("ratelimit_headers")
                if extra is None and state.get("principal") is not None:
                    extra = await _current_headers(scope, state)
                if extra:
                    present = {name.lower() for name, _ in message.get("headers", [])}
                    message["headers"] = list(message.get("headers", [])) + [
                        (k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()
                        if k.encode("latin-1") not in present
                    ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:
            # Answered here, not raised on: Starlette's outer handler would answer, then raise it
            # to the server, which logs it a second time and resets the connection, failing the
            # client's next request on it. A response already started cannot become a 500: the
            # server closes its connection.
            if started:
                raise
            await unexpected(exc)(scope, receive, send_with_headers)
        finally:
            for cleanup in reversed(state.get("cleanups") or []):
                try:
                    result = cleanup()
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("request cleanup failed")
