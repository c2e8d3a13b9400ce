"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, right status, never
a bare 500 for something the client did. The official SDKs map these statuses to their own
exception classes (400 BadRequestError, 404 NotFoundError, ...)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairway.conversation import InvalidText, StoreUnavailable

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


# What each error status means here, for the OpenAPI schema.
_MEANINGS = {
    400: "Bad request: a field is missing, of the wrong type or out of range (`param` names it), or text holds "
         "a NUL character (code invalid_text; in the URL, code invalid_request).",
    401: "No API key, or one that is malformed, unknown or revoked (code invalid_api_key).",
    404: "Not found: no such model, or no such conversation, reply or event for this user.",
    409: "A conflict: the conversation is still answering an earlier message (code conversation_busy), the "
         "idempotency key was used with another body or its first request is still starting, or the file is not "
         "ready yet.",
    413: "The request body is larger than the gateway accepts.",
    429: "Over the user's request rate or token quota; Retry-After says when to retry.",
    431: "The request headers are too large.",
    415: "The uploaded file's type is not one the gateway can read.",
    503: "Temporarily unavailable (overloaded, no live replica serves the model, a backend down); Retry-After "
         "when known.",
}
# Every route can meet these: the URL's NUL check and the body-size and header-size limits apply
# before any route runs.
EDGE_STATUSES = (400, 413, 431)


class ErrorObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorObject


_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that answers these statuses with an OpenAI error body (always
    JSON, also on a route whose success is an event stream). document() adds the schema."""
    return {status: {"description": _MEANINGS[status], "content": {"application/json": {"schema": _ERROR_REF}}}
            for status in statuses}


def document(openapi: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The app's OpenAPI schema, as this module answers: with the error body's schema, and without
    the 422 FastAPI lists on every route with parameters (validation errors are 400 here)."""

    def schema() -> dict[str, Any]:
        document = openapi()
        for path in document.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        return document

    return schema


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, param=param, code=code)


def unavailable(message: str, code: str | None = None) -> ApiError:
    return ApiError(503, message, code=code)


def unexpected(exc: Exception) -> JSONResponse:
    """The 500 for an error no handler knew, logged here once. It closes the connection: after an
    unknown failure the connection's state is not to be trusted, and the client learns from the
    header to open a new one rather than meet a reset on its next request."""
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, "The server had an error while processing your request.",
                    headers={"Connection": "close"}).response()


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        # PostgreSQL down, restarting or a connection lost midway: not the client's fault, and
        # the same request shortly after will likely work.
        log.warning("conversation store unavailable: %s", exc)
        return ApiError(503, "The conversation store is unavailable right now; retry shortly.",
                        code="store_unavailable", headers={"Retry-After": "1"}).response()

    @app.exception_handler(ConnectionError)
    async def _backend_unreachable(_: Request, exc: ConnectionError) -> JSONResponse:
        # A socket to a backend refused or reset where no store mapped it (an engine's connect to
        # PostgreSQL, say): the same as a store unavailable, not a bug of ours.
        log.warning("a backend is unreachable: %s", exc)
        return ApiError(503, "A backend the gateway needs is unavailable right now; retry shortly.",
                        code="backend_unavailable", headers={"Retry-After": "1"}).response()

    @app.exception_handler(InvalidText)
    async def _invalid_text(_: Request, exc: InvalidText) -> JSONResponse:
        # Text PostgreSQL cannot hold (a NUL) that got past the request checks: still the input's
        # fault, and SQLite would have stored it, so never a 500.
        log.info("text the database refused: %s", exc)
        return invalid("The request holds text the database cannot store, such as a NUL character (U+0000).",
                       code="invalid_text").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths, wrong methods: still OpenAI-shaped.
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is the offset of the error, not a field
            return invalid(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid')}.",
                           None).response()
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return invalid(f"{param or 'request'}: {first.get('msg', 'invalid')}", param).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost middleware runs this, then raises the error on to the server,
        # which logs it again and resets the connection: the edge middleware answers first
        # (edge.py); this is for an error outside it.
        return unexpected(exc)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response's body (for the OpenAPI schema)."""

    error: ErrorDetail


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """An endpoint's `responses=` for the OpenAPI schema: each error status with the error body."""
    words = {400: "Bad input", 401: "Missing or invalid API key", 404: "Not found", 413: "Body over the limit",
             429: "Over a rate limit", 503: "Unavailable"}
    return {status: {"model": ErrorBody, "description": words.get(status, "Error")} for status in statuses}
