"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, right status, never
a bare 500 for something the client did. The official SDKs map these statuses to their own
exception classes (400 BadRequestError, 404 NotFoundError, ...)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths, wrong methods: still OpenAI-shaped.
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return invalid(f"{param or 'request'}: {first.get('msg', 'invalid')}", param).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, "The server had an error while processing your request.").response()


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
