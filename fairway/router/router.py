"""Placement: which live replica gets a reply. Minimal for now: the least loaded replica of the
model (ties rotate). The registry's view is cached briefly: routing every request through a
Redis round trip buys nothing when replicas heartbeat once a second anyway."""

from __future__ import annotations

import asyncio
import itertools
import time

from fairway.replica.registry import ReplicaInfo, ReplicaRegistry


class NoReplica(RuntimeError):
    """No live replica serves the model (503: retry later)."""


class Router:
    def __init__(self, registry: ReplicaRegistry, cache_s: float = 0.5) -> None:
        self.registry = registry
        self._cache_s = cache_s
        self._cached: list[ReplicaInfo] = []
        self._cached_at = float("-inf")
        self._refreshing: asyncio.Future[list[ReplicaInfo]] | None = None
        self._turn = itertools.count()

    async def live(self, refresh: bool = False) -> list[ReplicaInfo]:
        if refresh or time.monotonic() - self._cached_at > self._cache_s:
            # One look at the registry for all the requests that found the view stale at once (a
            # busy gateway has dozens in flight when it expires), not one each.
            if self._refreshing is None:
                self._refreshing = asyncio.ensure_future(self._refresh())
            return await asyncio.shield(self._refreshing)
        return self._cached

    async def _refresh(self) -> list[ReplicaInfo]:
        try:
            self._cached = await self.registry.live()
            self._cached_at = time.monotonic()
            return self._cached
        finally:
            self._refreshing = None

    async def replicas_for(self, model: str) -> list[ReplicaInfo]:
        """Live replicas of the model that take new work (not draining)."""
        return [r for r in await self.live() if r.model == model and not r.draining]

    async def place(self, model: str) -> ReplicaInfo:
        candidates = await self.replicas_for(model)
        if not candidates:
            candidates = [r for r in await self.live(refresh=True) if r.model == model and not r.draining]
        if not candidates:
            raise NoReplica(f"no replica is serving model {model!r} right now; retry shortly")
        least = min(r.load for r in candidates)
        ties = [r for r in candidates if r.load == least]
        return ties[next(self._turn) % len(ties)]
