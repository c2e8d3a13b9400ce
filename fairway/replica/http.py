"""The replica's own small HTTP port (`fairway replica --metrics-port`): Prometheus's /metrics,
/live (the process answers), /ready (200 once the worker has announced itself and while it is
not draining; 503 before and from SIGTERM on) and POST /drain (drain as SIGTERM does; 202 at
once, the process ends when drained). Kubernetes' readiness probe and the fleet manager's local
backend both read /ready, its JSON body saying which it is; Kubernetes' preStop posts /drain and
waits for the process to end (deploy/k8s/replica.yaml), so the SIGTERM that follows finds it gone.

A handful of requests a minute from probes and a scraper: a plain asyncio server, in the
replica's own event loop, so it needs no thread and leaves the replica's signal handling alone
(uvicorn's server would install its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import fairway.usage.metrics  # noqa: F401  (registers the metrics /metrics shows)

# What /ready reports: (ready, draining).
Readiness = Callable[[], tuple[bool, bool]]
_REASONS = {200: "OK", 202: "Accepted", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def serve_http(host: str, port: int, readiness: Readiness, drain: Callable[[], None]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, path = _request_line(head)
            status, content_type, body = _answer(method, path, readiness, drain)
            writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass  # a probe that hung up or sent garbage gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)


def _request_line(head: bytes) -> tuple[str, str]:
    method, target, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    return method, target.split("?", 1)[0]


def _answer(method: str, path: str, readiness: Readiness, drain: Callable[[], None]) -> tuple[int, str, bytes]:
    if path not in ("/metrics", "/ready", "/live", "/drain"):
        return 404, "text/plain", b"not found\n"
    if path == "/drain":
        if method != "POST":
            return 405, "text/plain", b"POST only\n"
        drain()
        return 202, "application/json", b'{"draining":true}'
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"GET only\n"
    if path == "/metrics":
        return 200, CONTENT_TYPE_LATEST, generate_latest()
    if path == "/live":
        return 200, "application/json", b'{"live":true}'
    ready, draining = readiness()
    body = json.dumps({"ready": ready, "draining": draining}).encode()
    return (200 if ready else 503), "application/json", body
