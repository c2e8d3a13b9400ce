"""Request-rate limits per user (by tier) and per client IP: sliding window, 1 s buckets.

The two keys are checked together in one round trip (each atomically), not in one script: they
live in different Redis Cluster slots. When one refuses, the other's hit is refunded, so a request
refused by either limit counts against neither. The refund can briefly make the other look busier
than it is, never less busy: no overshoot.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairway.limits import _redis
from fairway.limits.config import LimitsConfig
from fairway.limits.window import Denied, WindowCounter, WindowState


@dataclass(frozen=True)
class Allowed:
    state: WindowState  # the user's request window after this request: x-ratelimit-*-requests
    counted: tuple[tuple[str, int], ...] = ()  # (key, bucket) of each window it went into: refund() takes it back


class RequestLimiter:
    def __init__(self, counter: WindowCounter, config: LimitsConfig) -> None:
        self._counter = counter
        self._config = config
        self._prefix = config.prefix

    def _user_key(self, user: str) -> str:
        return f"{self._prefix}rpm:user:{_redis.part(user)}"

    def _ip_key(self, ip: str) -> str:
        return f"{self._prefix}rpm:ip:{_redis.part(ip)}"

    def limit(self, tier: str) -> int:
        return self._config.tier(tier).requests_per_minute

    async def hit(self, user: str, tier: str, ip: str | None = None) -> Allowed | Denied:
        """Count one request for the user and (when given) the client IP, or refuse it."""
        limit, ip_limit = self.limit(tier), self._config.ip_requests_per_minute
        user_key = self._user_key(user)
        adds = [(user_key, 1, limit)] + ([(self._ip_key(ip), 1, ip_limit)] if ip else [])
        added, *by_ip = await self._counter.add_many(adds)
        if not added.ok:
            if by_ip and by_ip[0].ok:
                await self._counter.adjust(adds[1][0], by_ip[0].bucket, -1)
            return Denied("requests", limit, added.state.used, 1, added.retry_after, "user", added.state)
        if by_ip and not by_ip[0].ok:
            await self._counter.adjust(user_key, added.bucket, -1)
            return Denied("requests", ip_limit, by_ip[0].state.used, 1, by_ip[0].retry_after, "ip",
                          by_ip[0].state, ip)
        counted = [(user_key, added.bucket)] + ([(adds[1][0], by_ip[0].bucket)] if by_ip else [])
        return Allowed(added.state, tuple(counted))

    async def refund(self, allowed: Allowed) -> None:
        """Take back a request counted by hit() that the service refused for its own reasons (its
        load: overloaded, shed): the user's and the IP's windows alike, in the buckets it went into."""
        for key, bucket in allowed.counted:
            await self._counter.adjust(key, bucket, -1)

    async def state(self, user: str, tier: str) -> WindowState:
        return await self._counter.state(self._user_key(user), self.limit(tier))
