"""The gateway's HTTP protocol: the connection it lends each request (CONNECTION), to which SSE
events are written from the token log's callback by the gateway's token writer. Against a real
uvicorn server and a raw socket client: the writer writes real HTTP chunks of the response,
declines while the client is not reading (flow control) and once the connection is closing, and
mixes with the awaited send without reordering a byte; a HEAD request is lent nothing."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from serving import ThreadServer
from transports import dechunk

from fairway.gateway import token_writer
from fairway.gateway.http_protocol import connection_of
from fairway.gateway.sse import TokenTemplate

CHUNK = 64 * 1024
FILLER = b"0123456789abcdef" * (CHUNK // 16)
TEMPLATE = TokenTemplate((b"", FILLER, b"", b"\n"))  # events about as big as 64 KiB chunks


class App:
    """Writes token events with a token writer on the lent connection until it declines (the
    client is not reading), then the rest through the awaited send, and notes what it saw."""

    def __init__(self, kind: str) -> None:
        self.seen: dict[str, Any] = {}
        self.paused = threading.Event()
        self.kind = kind

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        connection = self.seen["connection"] = connection_of(scope)
        headers = [(b"content-type", b"text/plain")]
        if connection is None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*headers, (b"transfer-encoding", b"chunked")]})  # as EventStream declares it
        writer_class = token_writer.native_module().TokenWriter if self.kind == "native" else token_writer.PyTokenWriter
        writer = self.seen["writer"] = writer_class(TEMPLATE, connection)
        written = 0
        while written < 2000 and writer(written, ""):  # (~4 MB of kernel buffers on loopback)
            written += 1
        self.seen["written_now"] = written
        self.paused.set()
        await send({"type": "http.response.body", "body": b"<awaited>", "more_body": True})  # waits for the client
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.seen["after_end"] = writer(written, "")  # Connection: close: the connection is closing


def request(server: ThreadServer, method: str, app: App | None = None) -> bytes:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # small, so the server must pause
    client.connect(("127.0.0.1", server.port))
    client.sendall(f"{method} / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
    if app is not None:
        assert app.paused.wait(30), "the writer never declined while the client was not reading"
        time.sleep(0.2)  # the awaited send waits meanwhile
    raw = b""
    client.settimeout(30)
    while data := client.recv(1 << 20):
        raw += data
    client.close()
    return raw


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_writer_on_the_lent_connection_writes_until_the_client_stops_reading_and_keeps_order(kind: str) -> None:
    if kind == "native" and token_writer.native_module() is None:
        pytest.skip("no C compiler")
    app = App(kind)
    server = ThreadServer(app).start()
    try:
        raw = request(server, "GET", app)
    finally:
        server.stop()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.lower().count(b"transfer-encoding: chunked") == 1
    written = app.seen["written_now"]
    assert 0 < written < 2000
    chunks = dechunk(body)
    assert chunks[-1] == b"" and b"".join(chunks) == b"".join(
        app.seen["writer"].chunk(i, "") for i in range(written)) + b"<awaited>"
    assert app.seen["after_end"] is False


def test_a_head_request_is_lent_no_connection() -> None:
    app = App("python")
    server = ThreadServer(app).start()
    try:
        raw = request(server, "HEAD")
    finally:
        server.stop()
    assert raw.startswith(b"HTTP/1.1 200") and app.seen["connection"] is None
