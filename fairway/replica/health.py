"""The replica's health endpoint: a few lines of HTTP on the replica's own event loop.

GET /health answers 200 while the process's loop runs; GET /ready 200 once it serves and until it
drains or stops (503 then), for a supervisor's readiness check (Kubernetes) and the fleet manager's local
backend; GET /metrics the process's Prometheus metrics (fairway/usage/metrics.py), so a replica has
one port for all of it; POST /drain starts the drain SIGTERM starts (202; the process ends when drained), for
Kubernetes' preStop (deploy/k8s/replica.yaml), so the SIGTERM that follows finds it gone. Its address is announced in
every heartbeat (ReplicaInfo.health_url), so a router that misses heartbeats can ask the replica
itself: a refused connection means nothing listens there any more (the process died), and the
failover need not wait for the announcement to expire (router/probe.py).

Plain asyncio rather than a web framework: it answers a few fixed paths, and must cost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

_REASONS = {200: "OK", 202: "Accepted", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HealthServer:
    def __init__(self, ready: Callable[[], bool], host: str = "127.0.0.1", port: int = 0,
                 drain: Callable[[], None] | None = None) -> None:
        self.ready = ready  # whether /ready answers 200
        self.drain = drain  # what POST /drain calls (None: 404)
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """Where others reach it (the announced address): a wildcard bind announces this host's."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]  # port 0: the one the kernel chose

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path = request.split(b" ", 2)[:2] if request.count(b" ") >= 2 else (b"", b"")
            path = path.split(b"?", 1)[0]
            status, kind = self._status(method, path), b"text/plain"
            body = b"ok\n" if status == 200 else _REASONS[status].lower().encode() + b"\n"
            if path == b"/metrics" and status == 200:
                body, kind = generate_latest(), CONTENT_TYPE_LATEST.encode()
            writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (status, _REASONS[status].encode(), kind, len(body), body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    def _status(self, method: bytes, path: bytes) -> int:
        if path == b"/drain" and self.drain is not None:
            if method != b"POST":
                return 405  # a probe must not drain it
            self.drain()
            return 202
        if path in (b"/health", b"/metrics"):
            return 200
        if path == b"/ready":
            return 200 if self.ready() else 503
        return 404
