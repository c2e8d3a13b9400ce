"""The gateway's HTTP protocol: WRITE_NOW, the synchronous body write SSE events take from the
token log's callback, and the transport it lends a live_fast Tap. Against a real uvicorn server
and a raw socket client: both write real HTTP chunks, refuse before the response starts, while
the client is not reading (flow control) and after the response ended, and mix with the awaited
send without reordering a byte."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from serving import ThreadServer

from fairway.gateway.http_protocol import write_now_of
from fairway.relay import live_fast

CHUNK = 64 * 1024


def chunk(i: int) -> bytes:
    return f"{i:08d}".encode() * (CHUNK // 8)


class App:
    """Writes 64 KiB chunks with WRITE_NOW (or a Tap on the transport it lends) until it refuses
    (the client is not reading), then the rest through the awaited send, and notes what WRITE_NOW
    said at each point."""

    def __init__(self, tap: str | None = None) -> None:
        self.seen: dict[str, Any] = {}
        self.paused = threading.Event()
        self.tap = tap  # None: WRITE_NOW itself; "native" / "python": a live_fast Tap on the transport

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        write_now = write_now_of(scope)
        assert write_now is not None
        self.seen["before_start"] = write_now(b"too early")
        self.seen["transport_before_start"] = write_now.transport()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        write = write_now
        if self.tap is not None:
            tap_class = live_fast.native_module().Tap if self.tap == "native" else live_fast.PyTap
            # A Tap's chunk is an SSE event; head = 64 KiB of filler makes it about as big.
            tap = tap_class(chunk(0), write_now, [], transport=write_now.transport())
            self.seen["tap"] = tap

            def write(body: bytes) -> bool:
                return tap(written, "")
        written = 0
        while written < 2000 and write(chunk(written)):  # (~4 MB of kernel buffers on loopback)
            written += 1
        self.seen["written_now"] = written
        self.paused.set()
        await send({"type": "http.response.body", "body": b"<awaited>", "more_body": True})  # waits for the client
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.seen["after_end"] = write_now(b"too late")
        self.seen["transport_after_end"] = write_now.transport()


def dechunk(raw: bytes) -> bytes:
    body, rest = b"", raw
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


@pytest.mark.parametrize("tap", [None, "native", "python"])
def test_write_now_writes_chunks_until_the_client_stops_reading_and_keeps_order(tap: str | None) -> None:
    if tap == "native" and live_fast.native_module() is None:
        pytest.skip("no C compiler")
    app = App(tap)
    server = ThreadServer(app).start()
    try:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # small, so the server must pause
        client.connect(("127.0.0.1", server.port))
        client.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        assert app.paused.wait(30), "WRITE_NOW never refused while the client was not reading"
        time.sleep(0.2)  # the awaited send waits meanwhile
        raw = b""
        client.settimeout(30)
        while data := client.recv(1 << 20):
            raw += data
        client.close()
    finally:
        server.stop()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    written = app.seen["written_now"]
    assert 0 < written < 2000
    if tap is None:
        expected = b"".join(chunk(i) for i in range(written))
    else:
        expected = b"".join(app.seen["tap"].chunk(i, "") for i in range(written))
    assert dechunk(body) == expected + b"<awaited>"
    assert app.seen["before_start"] is False and app.seen["after_end"] is False
    assert app.seen["transport_before_start"] is None and app.seen["transport_after_end"] is None
