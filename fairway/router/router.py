"""Placement: which live replica gets a reply (the policy is in policy.py).

Candidates: the live replicas of the model (an announcement past its expiry is never one, even in
the cached view); in the requested region when the request names one, the other regions only
when it has none (the response then names the region that served: region_fallback()).

The registry's view is cached for RouterSettings.cache_s: routing every request through a Redis
round trip buys nothing when replicas heartbeat every 0.5 s anyway. A request naming a region the
cached view has no replica in takes a fresher look (at most REGION_MISS_S old) before it falls
back to another region: a replica that has just started there would otherwise be passed over.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

from fairway.block_hash import prefix_block_hashes
from fairway.domain import Lane
from fairway.replica.registry import ReplicaInfo, ReplicaRegistry
from fairway.router.placed import Placed
from fairway.router.policy import Choice, RouterSettings, choose
from fairway.router.pressure import Pressure, pool_pressure, under_limit
from fairway.usage import metrics


class NoReplica(RuntimeError):
    """No live replica serves the model (503: retry later)."""


RETRY_AFTER_S = 2  # a replica that is starting announces itself within a heartbeat or two
REGION_MISS_S = 0.05  # the oldest view a region with no replica in it is judged on


def region_fallback(requested: str | None, replica: ReplicaInfo) -> str | None:
    """The region that served a request placed outside the one it asked for, else None."""
    return replica.region if requested and replica.region != requested else None


class Router:
    def __init__(self, registry: ReplicaRegistry, settings: RouterSettings | None = None,
                 cache_s: float | None = None) -> None:
        self.registry = registry
        self.settings = settings or RouterSettings()
        self._cache_s = self.settings.cache_s if cache_s is None else cache_s
        self._cached: list[ReplicaInfo] = []
        self._cached_at = float("-inf")
        self._refreshing: asyncio.Future[list[ReplicaInfo]] | None = None
        self._turn = itertools.count()
        self._placed = Placed()

    async def live(self, refresh: bool = False, max_age_s: float | None = None) -> list[ReplicaInfo]:
        """Live replicas (sorted by id), from the cached view unless it is stale (older than
        max_age_s, by default the settings' cache_s)."""
        max_age_s = self._cache_s if max_age_s is None else max_age_s
        if refresh or time.monotonic() - self._cached_at > max_age_s:
            # One look at the registry for all the requests that found the view stale at once (a
            # busy gateway has dozens in flight when it expires), not one each.
            if self._refreshing is None:
                self._refreshing = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._refreshing)
        now = time.monotonic()
        return [r for r in self._cached if r.expires_at > now]

    async def _refresh(self) -> list[ReplicaInfo]:
        try:
            self._cached = sorted(await self.registry.live(), key=lambda r: r.id)
            self._cached_at = time.monotonic()
            self._placed.forget_except({r.id for r in self._cached})
            return self._cached
        finally:
            self._refreshing = None

    async def replicas_for(self, model: str, max_age_s: float | None = None) -> list[ReplicaInfo]:
        """Live replicas of the model that take new work (not draining)."""
        return [r for r in await self.live(max_age_s=max_age_s) if r.model == model and not r.draining]

    async def serving(self, model: str) -> list[ReplicaInfo]:
        """The live replicas of the model, after a fresh look when the cached view has none
        (one may have just started). Raises NoReplica."""
        candidates = await self.replicas_for(model)
        if not candidates:
            candidates = [r for r in await self.live(refresh=True) if r.model == model and not r.draining]
        if not candidates:
            raise NoReplica(f"No replica is serving model {model!r} right now; retry in a few seconds.")
        return candidates

    async def mini_pool(self, model: str) -> str | None:
        """The model of the main model's mini pool, if a replica of one is live."""
        return next((r.model for r in await self.live() if r.mini_of == model and not r.draining), None)

    async def pressure(self, model: str, lane: Lane) -> Pressure:
        """How long a new reply of this lane would wait in the model's pool (pressure.py).
        Raises NoReplica."""
        return pool_pressure(await self.serving(model), lane, self._placed.since_heartbeat, self.settings.pressure)

    def load(self, replica: ReplicaInfo) -> int:
        """Its announced load plus what this gateway placed on it since it measured that."""
        return replica.load + self._placed.since_heartbeat(replica)

    async def place(self, model: str, prompt_token_ids: Sequence[int] | None = None,
                    region: str | None = None, lane: Lane | None = None) -> ReplicaInfo:
        """The replica for a prompt (None: no affinity to weigh) of this model, in this region if
        it has one; a free request's among those not predicted past the wait limit, when any
        is. Raises NoReplica."""
        return (await self.choose(model, prompt_token_ids, region, lane)).replica

    async def choose(self, model: str, prompt_token_ids: Sequence[int] | None = None,
                     region: str | None = None, lane: Lane | None = None) -> Choice:
        candidates = await self.serving(model)
        if region and not any(r.region == region for r in candidates):
            candidates = await self.replicas_for(model, max_age_s=REGION_MISS_S) or candidates
        if region:
            candidates = [r for r in candidates if r.region == region] or candidates
        if lane is not None:
            candidates = under_limit(candidates, lane, self._placed.since_heartbeat, self.settings.pressure)
        hashes: dict[int, list[int]] = {}

        def score(replica: ReplicaInfo) -> int:
            if not prompt_token_ids or replica.prefix is None:
                return 0
            if replica.block_size not in hashes:  # hashed once per block size, as that engine hashes
                hashes[replica.block_size] = prefix_block_hashes(list(prompt_token_ids), replica.block_size)
            return replica.prefix.leading_hits(hashes[replica.block_size])

        choice = choose(candidates, self.load, score if len(candidates) > 1 else lambda _: 0, self.settings,
                        next(self._turn))
        self._placed.add(choice.replica.id)
        metrics.ROUTER_PLACEMENTS.labels(model, choice.reason).inc()
        return choice
