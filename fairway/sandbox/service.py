"""The sandbox as a service of its own: `fairway sandbox` serves this small gRPC API for many
tenants at once, and replicas reach it by URL (grpc://host:port) through GrpcSandbox.

    service fairway.sandbox.v1.Sandbox {
      rpc Run(RunRequest) returns (RunResult);    // {"code", "limits": {...}, "tenant"} -> RunResult
      rpc Check(CheckRequest) returns (Status);  // {} -> {"unavailable": null | "why"}
    }

The messages are JSON (grpcio's own serializer hooks; no generated code): the request's limits
are those of limits.SandboxLimits, the answer a limits.RunResult. A client may ask for less than
the service's ceiling, never more. A run the sandbox refuses answers a result with `error`, not
a gRPC error: gRPC errors mean the service itself could not be reached or used.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

# gRPC's fork handlers crash a child forked while its threads run (the runner forks for every run,
# and so may anything else in a process that holds a channel); without them a forked child that
# execs at once, as every child here does, is safe. Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

from fairway.sandbox.limits import RunResult, SandboxLimits
from fairway.sandbox.runner import Sandbox

log = logging.getLogger(__name__)

SERVICE = "fairway.sandbox.v1.Sandbox"
_MAX_MESSAGE = 4 * 1024 * 1024  # a request holds code_bytes of code; a result, two outputs


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _loads(data: bytes) -> Any:
    return json.loads(data)


class SandboxService:
    """The RPC handlers over one sandbox (in practice a LocalSandbox)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def run(self, request: Any, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        if not isinstance(request, dict) or not isinstance(request.get("code"), str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a RunRequest is {code: string, limits?, tenant?}")
        try:
            limits = SandboxLimits.from_dict(request.get("limits") or {})
        except (TypeError, ValueError, AttributeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tenant = str(request.get("tenant") or "")
        result = await self.sandbox.run(request["code"], limits, tenant)
        return result.to_dict()

    async def check(self, request: Any, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        return {"unavailable": await self.sandbox.check()}

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {
            "Run": grpc.unary_unary_rpc_method_handler(self.run, request_deserializer=_loads,
                                                       response_serializer=_dumps),
            "Check": grpc.unary_unary_rpc_method_handler(self.check, request_deserializer=_loads,
                                                         response_serializer=_dumps),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)


async def start_server(sandbox: Sandbox, listen: str) -> tuple[grpc.aio.Server, int]:
    """Serve the sandbox on listen (host:port; port 0 picks one); the server and its port.
    ValueError for an address that is not host:port, OSError naming why it cannot be bound."""
    host, port = parse_listen(listen)
    _probe_bind(host, port)
    # gRPC sets SO_REUSEPORT by default: a second sandbox on a taken address would bind too and
    # take half the connections.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                      ("grpc.max_send_message_length", _MAX_MESSAGE),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((SandboxService(sandbox).handler(),))
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # (taken between the probe and here)
        raise OSError(f"could not listen on {listen}: {exc}") from None
    if port == 0:
        raise OSError(f"could not listen on {listen}")
    await server.start()
    return server, port


def parse_listen(listen: str) -> tuple[str, int]:
    """host:port (or [v6]:port) as (host, port). gRPC itself takes port 99999 as a free port."""
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen takes host:port, the port 0 to 65535 (0: a free one), not {listen!r}")
    return host, int(port)


def _probe_bind(host: str, port: int) -> None:
    """Bind the address as gRPC will (SO_REUSEADDR, no SO_REUSEPORT) and let it go: an unknown
    host or a taken port is then an OSError that says so, where gRPC gives a bare "Failed to
    bind" after lines of its own log."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


def target_of(url: str) -> str:
    """grpc://host:port (or plain host:port) as grpcio's target."""
    return url.removeprefix("grpc://").rstrip("/")


class GrpcSandbox(Sandbox):
    """The service's client: the same interface as the in-process runner."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s  # beyond the run's own wall time: the call's slack
        self._channel: grpc.aio.Channel | None = None

    def _call(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                target_of(self.url), options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                              ("grpc.max_send_message_length", _MAX_MESSAGE)])
        return self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_dumps,
                                         response_deserializer=_loads)

    async def check(self) -> str | None:
        try:
            answer = await self._call("Check")({}, timeout=self.timeout_s + 5.0)  # (the service's own probe: a run)
        except grpc.aio.AioRpcError as exc:
            return f"the sandbox service at {self.url} is unreachable: {exc.details() or exc.code().name}"
        return answer.get("unavailable")

    async def run(self, code: str, limits: SandboxLimits | None = None, tenant: str = "") -> RunResult:
        limits = limits or SandboxLimits()
        request = {"code": code, "limits": limits.to_dict(), "tenant": tenant}
        try:
            answer = await self._call("Run")(request, timeout=limits.wall_s + self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            return RunResult.failed(f"the sandbox service at {self.url} failed: {exc.details() or exc.code().name}")
        return RunResult.from_dict(answer)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def make_sandbox(url: str | None) -> Sandbox:
    """The sandbox a replica uses: the service at url, or (None / "local") the runner in process."""
    from fairway.sandbox.runner import LocalSandbox

    if not url or url == "local":
        return LocalSandbox()
    return GrpcSandbox(url)
