"""Request body limit, enforced while the body streams in, before anything parses it."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fairway.gateway.errors import ApiError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long chat turn is ~10 KB; files come through their own API
UPLOAD_PATHS = ("/v1/files",)  # where bodies may be as large as upload_max_bytes
MULTIPART_SLACK = 64 << 10  # a multipart body's boundaries and fields around the file


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """413 for a body over max_bytes: at once when Content-Length says so, else when the streamed
    bytes pass the limit (chunked uploads carry no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, upload_max_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.upload_max_bytes = max(upload_max_bytes or 0, max_bytes)

    def _error(self, limit: int) -> ApiError:
        return ApiError(413, f"Request body is larger than the {limit} bytes allowed.", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_max_bytes if scope.get("path", "").startswith(UPLOAD_PATHS) else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._error(limit).response()(scope, receive, send)
            return
        received = 0
        started = over = replaced = False

        async def limited_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started, replaced
            if replaced:
                return
            if over and not started and message["type"] == "http.response.start":
                # The app caught BodyTooLarge itself (FastAPI's form and JSON parsing turn any
                # error reading the body into a 400): the answer is the 413 all the same.
                replaced = True
                await self._error(limit).response()(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._error(limit).response()(scope, receive, send)
