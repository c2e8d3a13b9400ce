"""Request-rate limits per user (by tier) and per client IP: sliding window, 1 s buckets.

The two keys are checked one after the other (each atomically), not in one script: they live in
different Redis Cluster slots. When the user fits but the IP does not, the user's hit is refunded,
so a request refused by either limit counts against neither. The refund can briefly make the user
look busier than they are, never less busy: no overshoot.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairway.limits import _redis
from fairway.limits.config import LimitsConfig
from fairway.limits.window import Denied, WindowCounter, WindowState


@dataclass(frozen=True)
class Allowed:
    state: WindowState  # the user's request window after this request: x-ratelimit-*-requests


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
        limit = self.limit(tier)
        user_key = self._user_key(user)
        added = await self._counter.add(user_key, 1, limit)
        if not added.ok:
            return Denied("requests", limit, added.state.used, 1, added.retry_after, "user", added.state)
        if ip:
            ip_limit = self._config.ip_requests_per_minute
            by_ip = await self._counter.add(self._ip_key(ip), 1, ip_limit)
            if not by_ip.ok:
                await self._counter.adjust(user_key, added.bucket, -1)
                return Denied("requests", ip_limit, by_ip.state.used, 1, by_ip.retry_after, "ip",
                              by_ip.state, ip)
        return Allowed(added.state)

    async def state(self, user: str, tier: str) -> WindowState:
        return await self._counter.state(self._user_key(user), self.limit(tier))
