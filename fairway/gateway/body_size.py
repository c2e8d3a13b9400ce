"""Request body limit, enforced while the body streams in, before anything parses it."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fairway.gateway.errors import ApiError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long chat turn is ~10 KB; files come through their own API


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """413 for a body over max_bytes: at once when Content-Length says so, else when the streamed
    bytes pass the limit (chunked uploads carry no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> ApiError:
        return ApiError(413, f"Request body is larger than the {self.max_bytes} bytes allowed.", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._error().response()(scope, receive, send)
