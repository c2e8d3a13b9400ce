"""The gateway's HTTP protocol: WRITE_NOW, the synchronous body write SSE events take from the
token log's callback. Against a real uvicorn server and a raw socket client: it writes real HTTP
chunks, refuses before the response starts, while the client is not reading (flow control) and
after the response ended, and mixes with the awaited send without reordering a byte."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from serving import ThreadServer

from fairway.gateway.http_protocol import write_now_of

CHUNK = 64 * 1024


def chunk(i: int) -> bytes:
    return f"{i:08d}".encode() * (CHUNK // 8)


class App:
    """Writes 64 KiB chunks with WRITE_NOW until it refuses (the client is not reading), then the
    rest through the awaited send, and notes what WRITE_NOW said at each point."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.paused = threading.Event()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        write_now = write_now_of(scope)
        assert write_now is not None
        self.seen["before_start"] = write_now(b"too early")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        written = 0
        while written < 2000 and write_now(chunk(written)):  # (~4 MB of kernel buffers on loopback)
            written += 1
        self.seen["written_now"] = written
        self.paused.set()
        await send({"type": "http.response.body", "body": b"<awaited>", "more_body": True})  # waits for the client
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.seen["after_end"] = write_now(b"too late")


def dechunk(raw: bytes) -> bytes:
    body, rest = b"", raw
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


def test_write_now_writes_chunks_until_the_client_stops_reading_and_keeps_order() -> None:
    app = App()
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
    assert dechunk(body) == b"".join(chunk(i) for i in range(written)) + b"<awaited>"
    assert app.seen["before_start"] is False and app.seen["after_end"] is False
