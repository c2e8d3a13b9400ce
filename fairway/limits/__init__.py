"""Limits at the edge: token quotas (TPM), request rates, rate-limit headers, idempotency keys,
the admission queue and single-flight.

make_limits(None, config) gives the in-process backends for the one-process server; a redis://
URL gives the Redis backends shared by many gateways (admission stays per process by design, see
admission.py). Callers only see the interfaces bundled in Limits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fairway.limits import _redis
from fairway.limits.admission import Admission, Slot
from fairway.limits.config import LimitsConfig, Tier, TierLimits, default_tiers
from fairway.limits.errors import LimitsError, LimitsUnavailable, Overloaded
from fairway.limits.headers import format_reset, rate_limit_headers, request_rate_headers
from fairway.limits.idempotency import (
    MAX_KEY_LENGTH,
    Claimed,
    Existing,
    IdempotencyStore,
    InProcessIdempotency,
    RedisIdempotency,
    body_fingerprint,
    check_key,
)
from fairway.limits.quota import Reservation, TokenQuota
from fairway.limits.rate import Allowed, RequestLimiter
from fairway.limits.singleflight import (
    Flight,
    InProcessSingleFlight,
    RedisSingleFlight,
    SingleFlight,
    flight_fingerprint,
    is_cacheable,
)
from fairway.limits.window import Denied, InProcessWindow, RedisWindow, WindowCounter, WindowState
from fairway.redis_client import RedisClient

log = logging.getLogger(__name__)

# After the store failed, responses go without x-ratelimit-* headers this long, without asking it.
HEADERS_HOLD_S = 5.0


@dataclass
class Limits:
    config: LimitsConfig
    tokens: TokenQuota
    requests: RequestLimiter
    idempotency: IdempotencyStore
    admission: Admission
    flights: SingleFlight
    _redis: RedisClient | None = None
    window: WindowCounter | None = None  # the one the quotas and rates count in

    async def headers(self, user: str, model: str, tier: str) -> dict[str, str] | None:
        """The six x-ratelimit-* headers from the current state (two reads). On the request path
        prefer rate_limit_headers(allowed.state, reservation.state): no extra round trip.

        None while the store is unreachable, and for HEADERS_HOLD_S after it last failed, without
        asking: the headers are a courtesy on responses that did not need the limits, and a
        stalled Redis must not add its timeout to each of them (nor a traceback to the log)."""
        if self.window is not None and time.monotonic() - self.window.failed_at < HEADERS_HOLD_S:
            return None
        try:
            return rate_limit_headers(await self.requests.state(user, tier),
                                      await self.tokens.state(user, model, tier))
        except LimitsUnavailable as exc:
            log.warning("x-ratelimit-* headers left off for %.0f s: %s", HEADERS_HOLD_S, exc)
            return None

    async def ping(self) -> None:
        """At startup: LimitsUnavailable now rather than on the first request."""
        if self._redis is not None:
            with _redis.guard():
                await self._redis.ping()

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.close()


def make_limits(redis_url: str | None, config: LimitsConfig | None = None) -> Limits:
    """None or "memory://" -> in-process backends; "redis://", "rediss://", "unix://" -> Redis."""
    config = config or LimitsConfig()
    admission = Admission(config.max_in_flight, config.max_waiting, config.admission_timeout_s)
    if redis_url in (None, "", "memory://"):
        counter: WindowCounter = InProcessWindow(config.window_s, config.buckets, config.clock)
        return Limits(
            config,
            TokenQuota(counter, config),
            RequestLimiter(counter, config),
            InProcessIdempotency(config.idempotency_ttl_s, config.clock, config.idempotency_claim_ttl_s),
            admission,
            InProcessSingleFlight(config.flight_ttl_s, config.flight_wait_s, clock=config.clock),
            window=counter,
        )
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"unsupported limits URL {redis_url!r}: use memory:// or redis://host:port/db")
    client = _redis.connect(redis_url, connect_timeout_s=config.connect_timeout_s,
                            socket_timeout_s=config.socket_timeout_s)
    counter = RedisWindow(client, config.window_s, config.buckets, config.clock)
    return Limits(
        config,
        TokenQuota(counter, config),
        RequestLimiter(counter, config),
        RedisIdempotency(client, config.idempotency_ttl_s, config.prefix, config.idempotency_claim_ttl_s),
        admission,
        RedisSingleFlight(client, config.flight_ttl_s, config.flight_wait_s, prefix=config.prefix),
        client,
        counter,
    )


__all__ = [
    "MAX_KEY_LENGTH",
    "Admission",
    "Allowed",
    "Claimed",
    "Denied",
    "Existing",
    "Flight",
    "IdempotencyStore",
    "InProcessIdempotency",
    "InProcessSingleFlight",
    "InProcessWindow",
    "Limits",
    "LimitsConfig",
    "LimitsError",
    "LimitsUnavailable",
    "Overloaded",
    "RedisIdempotency",
    "RedisSingleFlight",
    "RedisWindow",
    "RequestLimiter",
    "Reservation",
    "SingleFlight",
    "Slot",
    "Tier",
    "TierLimits",
    "TokenQuota",
    "WindowCounter",
    "WindowState",
    "body_fingerprint",
    "check_key",
    "default_tiers",
    "flight_fingerprint",
    "format_reset",
    "is_cacheable",
    "make_limits",
    "rate_limit_headers",
    "request_rate_headers",
]
