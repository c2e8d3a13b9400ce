"""The gateway's HTTP server protocol: uvicorn's httptools protocol, lending each request's
connection to the app, so an SSE stream can write its token events from the token log's callback,
without a task.

An SSE stream's events arrive in the token log's live-event callback. Handing each to the
stream's task (wake it, resume its generators, await the ASGI send) costs several times more
CPU than writing it, and at thousands of streams a gateway process spends most of its time
there. So each request's scope carries CONNECTION: the connection's transport, which the protocol
was given (asyncio's connection_made). A chunked response's body may be written to it as HTTP/1.1
chunks (streaming.EventStream declares Transfer-Encoding: chunked itself, so the framing is the
response's own, not the server's choice) by a writer that minds the transport's own state:
nothing while it is closing, nothing while it has a backlog, so flow control and byte order stay
the server's (token_writer). The stream writes that way only between its response's start and
its end, and only while its own send is not in progress (streaming.ReplyRelay.sse: while its
task waits for events).

Nothing of uvicorn's request state is read. The one thing this takes from uvicorn beyond its
public hooks: its protocol keeps the scope it builds for a request in self.scope (made in the
parser's on_message_begin, handed to the request's cycle in on_headers_complete), where CONNECTION
is added. A server without this protocol gives no CONNECTION, and streams then write everything
through their task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

CONNECTION = "fairway.connection"  # key in scope["extensions"]


def connection_of(scope: dict[str, Any]) -> asyncio.WriteTransport | None:
    """The request's connection, lent by the server for its chunked response's body; None under
    another server, and for a HEAD request (whose response has no body)."""
    return scope.get("extensions", {}).get(CONNECTION)


class GatewayHttpProtocol(HttpToolsProtocol):
    connection: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.connection = transport

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]  (uvicorn's: see the module docstring)
        if scope.get("method") not in (None, "HEAD"):
            scope.setdefault("extensions", {})[CONNECTION] = self.connection


def server_config(app: Any, host: str, port: int, log_level: str, **options: Any) -> uvicorn.Config:
    """How Fairway serves an ASGI app (the CLI and the tests alike): with this protocol."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=GatewayHttpProtocol, **options)
