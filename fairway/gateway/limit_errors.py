"""The limits' answers in OpenAI's shape: 429 (type tokens or requests, code rate_limit_exceeded)
with Retry-After, 503 + Retry-After when the gateway's admission queue is full, 503 at once when
the shared limits store is unreachable (a request that cannot be counted is not admitted)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from fairway.gateway.errors import ApiError, invalid
from fairway.limits import Denied, LimitsUnavailable, Overloaded
from fairway.usage import metrics

T = TypeVar("T")


async def guarded(call: Awaitable[T]) -> T:
    try:
        return await call
    except LimitsUnavailable as exc:
        raise ApiError(503, f"Rate limits are unavailable right now ({exc}); retry shortly.",
                       code="limits_unavailable", headers={"Retry-After": "1"}) from None


def denied_error(denied: Denied, headers: dict[str, str]) -> ApiError:
    """429 for a limit that frees up with time. A request that alone exceeds the limit can never
    run, so retrying is pointless: that is a 400 (no Retry-After)."""
    if denied.type == "tokens" and denied.too_large:
        return ApiError(400, denied.message(), param="max_tokens", code="request_too_large",
                        type="invalid_request_error", headers=headers)
    return ApiError(429, denied.message(), code="rate_limit_exceeded", type=denied.type,
                    headers={**headers, "Retry-After": denied.retry_after_header})


def overloaded_error(exc: Overloaded) -> ApiError:
    return ApiError(503, "The server is overloaded with requests right now; retry after "
                         f"{exc.retry_after_header} s.", code="overloaded", type="server_error",
                    headers={"Retry-After": exc.retry_after_header})


def count_refusal(error: ApiError) -> None:
    """fairway:rate_limited, by the answer a request got, once it is the answer: a 429 by its
    type (tokens, requests), the admission queue's 503 as admission. A request too large for its
    quota (400 request_too_large) was never rate limited: fairway:chat_requests counts it under its
    own code. Nor was one whose quota for the model was spent but that the mini pool then served
    (its denial was made, then not raised)."""
    if error.code == "rate_limit_exceeded":
        metrics.RATE_LIMITED.labels(error.type).inc()
    elif error.code == "overloaded":
        metrics.RATE_LIMITED.labels("admission").inc()


def check_max_tokens(max_tokens: int | None, limit: int, model: str) -> None:
    """max_tokens larger than the whole per-minute quota could never be admitted: say so plainly."""
    if max_tokens is not None and max_tokens > limit:
        raise invalid(f"max_tokens is {max_tokens}, more than your limit of {limit} tokens per minute for "
                      f"{model}: such a request could never run. Lower max_tokens.", "max_tokens",
                      "max_tokens_exceeds_quota")

