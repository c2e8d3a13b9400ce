"""Who is asking: the bearer key, checked against the stored (hashed) keys.

A missing key, one in the wrong format, an unknown or a revoked one all get 401 in OpenAI's shape
(code invalid_api_key). Everything a user owns is looked up with their user id, so another user's
conversation, reply or usage is simply not found (404): existence does not leak.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fairway.gateway.app_state import gateway
from fairway.gateway.errors import ApiError
from fairway.gateway.keys import InvalidKey, Principal

log = logging.getLogger(__name__)

NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
          "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


# The bearer scheme as the OpenAPI schema states it; it checks nothing itself (authenticate does,
# with OpenAI's 401 body).
BEARER = HTTPBearer(scheme_name="bearer", auto_error=False, description="Authorization: Bearer sk-...")
# For a route that calls authenticate itself: states the same requirement in the schema.
BEARER_REQUIRED = {"security": [{"bearer": []}]}


def unauthorized(message: str) -> ApiError:
    # OpenAI answers bad keys with type invalid_request_error, code invalid_api_key.
    return ApiError(401, message, code="invalid_api_key", type="invalid_request_error",
                    headers={"WWW-Authenticate": 'Bearer realm="fairway"'})


async def authenticate(request: Request) -> Principal:
    """The request's Principal (cached on request.state), or a 401."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    header = request.headers.get("authorization")
    if not header or not header.strip():
        raise unauthorized(NO_KEY)
    scheme, _, key = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("Incorrect API key format: use 'Authorization: Bearer YOUR_KEY'.")
    try:
        principal = await gateway(request).keys.check(key.strip())
    except InvalidKey as exc:
        raise unauthorized(exc.message) from None
    except Exception as exc:  # the key store is down: not the client's fault, and not a 500
        log.warning("cannot check API keys", exc_info=True)
        raise ApiError(503, "API keys cannot be checked right now; retry shortly.", code="auth_unavailable",
                       headers={"Retry-After": "1"}) from exc
    request.state.principal = principal
    return principal


async def authenticated(request: Request,
                        _: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)] = None) -> Principal:
    """The dependency of every /v1 route but chat completions (which calls authenticate itself).
    The edge middleware adds the x-ratelimit-* headers to the response."""
    return await authenticate(request)


def user_id(request: Request) -> str:
    """The authenticated user (routes run after `authenticated`)."""
    return request.state.principal.user_id
