"""The gateway's ASGI app: the OpenAI-compatible API plus replies and conversations."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from fairway.gateway import (
    chat,
    conversations,
    errors,
    files,
    health,
    memory,
    moderations,
    replies,
    usage_routes,
    web,
)
from fairway.gateway.app_state import GatewayContext
from fairway.gateway.body_size import MAX_BODY_BYTES, MULTIPART_SLACK, BodySizeLimit
from fairway.gateway.edge import MAX_HEADER_BYTES, EdgeMiddleware


def create_app(context: GatewayContext, max_body_bytes: int = MAX_BODY_BYTES,
               max_header_bytes: int = MAX_HEADER_BYTES) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for hook in context.on_startup:
            await hook()
        try:
            yield
        finally:
            for hook in reversed(context.on_shutdown):
                with contextlib.suppress(Exception):
                    await hook()

    # FastAPI's OpenTelemetry hooks are off: Fairway's telemetry is its own Prometheus metrics
    # (/metrics), and the hooks would otherwise look for providers on every request.
    app = FastAPI(title="Fairway", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False},
                  responses=errors.error_responses(*errors.EDGE_STATUSES))
    app.state.gateway = context
    errors.install(app)
    upload_max = context.files.settings.max_file_bytes + MULTIPART_SLACK if context is not None and context.files else None
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, upload_max_bytes=upload_max)
    app.add_middleware(EdgeMiddleware, max_header_bytes=max_header_bytes)  # outermost: sees every response
    for module in (chat, moderations, replies, conversations, files, health, memory, usage_routes, web):
        app.include_router(module.router)
    app.openapi = errors.document(app.openapi)  # type: ignore[method-assign]
    return app

