"""The gateway's HTTP server protocol: uvicorn's httptools protocol, plus one way to write a
streamed body chunk without a task.

An SSE stream's events arrive in the token log's live-event callback. Handing each to the
stream's task (wake it, resume its generators, await the ASGI send) costs several times more
CPU than writing it, and at thousands of streams a gateway process spends most of its time
there. So each request's scope carries WRITE_NOW, a DirectWriter: called, it writes one body chunk
of its response straight to the connection when that is what the awaited ASGI send would do at
once (response started, chunked, not finished, not paused by flow control, client still there),
and otherwise returns False, leaving the chunk to the awaited send; its transport() lends the
connection itself to a writer that frames the chunks and minds flow control on its own (the relay's
C path, live_fast). They all write to the same transport in the order they are called, so a
stream may mix them as long as it never writes directly while its own send is in progress
(streaming.ReplyRelay.sse only does while its task waits for events).

It reads uvicorn's RequestResponseCycle state (uvicorn is pinned); a server without this
protocol gives no WRITE_NOW, and streams then write everything through their task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

WRITE_NOW = "fairway.write_now"  # key in scope["extensions"]


class DirectWriter:
    """WRITE_NOW: write_now(body) writes one body chunk of the response now if the awaited send
    would (response started, chunked, not finished, not paused by flow control, client still
    there), else says False. transport() is the connection itself while the response is a started,
    unfinished chunked one, for a writer that frames HTTP chunks and minds the transport's own
    state (live_fast's Tap), else None."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle

    def __call__(self, body: bytes) -> bool:
        transport = self.transport()
        if transport is None or self.cycle.flow.write_paused:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(body), body))  # one HTTP/1.1 chunk, as send() frames it
        return True

    def transport(self) -> asyncio.WriteTransport | None:
        cycle = self.cycle
        if cycle.disconnected or not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
            return None
        return cycle.transport


def write_now_of(scope: dict[str, Any]) -> DirectWriter | None:
    return scope.get("extensions", {}).get(WRITE_NOW)


class GatewayHttpProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a request starts (not an upgrade): its scope gets WRITE_NOW
            self.cycle.scope.setdefault("extensions", {})[WRITE_NOW] = DirectWriter(self.cycle)  # type: ignore[index]


def server_config(app: Any, host: str, port: int, log_level: str, **options: Any) -> uvicorn.Config:
    """How Fairway serves an ASGI app (the CLI and the tests alike): with this protocol."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=GatewayHttpProtocol, **options)
