"""Token quotas (TPM) per user per model: reserve at admission, settle at the end, release on
stop / shed / error.

reserve() counts prompt tokens + max_tokens in one atomic check-and-add (a Lua script on Redis,
a lock-free critical section in process), so concurrent requests can never overshoot: the most a
user can be admitted is the limit. settle() then lowers (or, rarely, raises) the reservation to
what the reply really used; release() gives all of it back.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from fairway.limits import _redis
from fairway.limits.config import LimitsConfig
from fairway.limits.window import Denied, WindowCounter, WindowState


@dataclass
class Reservation:
    user: str
    model: str
    tier: str
    tokens: int  # what was reserved: prompt + max_tokens
    state: WindowState  # usage right after reserving: the x-ratelimit-*-tokens headers
    bucket: int  # the window bucket the tokens went into; settle/release adjust it
    key: str = field(repr=False)
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    closed: bool = field(default=False, repr=False)  # settled or released: later calls are no-ops


class TokenQuota:
    """Backend-agnostic: the atomicity lives in the WindowCounter (in-process or Redis)."""

    def __init__(self, counter: WindowCounter, config: LimitsConfig) -> None:
        self._counter = counter
        self._config = config
        self._prefix = config.prefix

    def _key(self, user: str, model: str) -> str:
        return f"{self._prefix}tpm:{_redis.part(user)}:{_redis.part(model)}"

    def limit(self, tier: str, model: str) -> int:
        return self._config.tokens_per_minute(tier, model)

    async def reserve(self, user: str, model: str, tier: str, tokens: int) -> Reservation | Denied:
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of tokens ({tokens})")
        key, limit = self._key(user, model), self.limit(tier, model)
        added = await self._counter.add(key, tokens, limit)
        if not added.ok:
            return Denied("tokens", limit, added.state.used, tokens, added.retry_after, "user:model",
                          added.state, model)
        return Reservation(user, model, str(tier), tokens, added.state, added.bucket, key)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Count what the reply really used (prompt + completion). Once per reservation."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0 (got {actual_tokens})")
        await self._close(reservation, actual_tokens - reservation.tokens)

    async def release(self, reservation: Reservation) -> None:
        """Give the whole reservation back: the request never ran (shed, error, refused later)."""
        await self._close(reservation, -reservation.tokens)

    async def _close(self, reservation: Reservation, delta: int) -> None:
        if reservation.closed:
            return  # settle after release (or twice) would count the same tokens twice
        # Closed before the await, so a concurrent second call sees it. If the store is down the
        # adjustment is lost: the user is over-counted until the bucket ages out, never under.
        reservation.closed = True
        await self._counter.adjust(reservation.key, reservation.bucket, delta)

    async def state(self, user: str, model: str, tier: str) -> WindowState:
        return await self._counter.state(self._key(user, model), self.limit(tier, model))
