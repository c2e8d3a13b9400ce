"""Single-flight: identical cacheable requests (same model, same messages, temperature 0) share
one generation. The first becomes the leader and starts the reply; the others get its reply id
and stream it from the token log, which any gateway can read.

One protocol, two backends. A flight key moves through:
  absent -> "pending:<token>" (a leader is starting the reply) -> "reply:<id>" (published)
In Redis that is SET NX with a TTL (a leader that dies mid-start frees the key when the pending
TTL runs out) and compare-and-set scripts; in process, a dict plus an asyncio.Event per key so
followers wake the moment the leader publishes instead of polling.

A published flight keeps serving identical requests for flight_ttl_s (a short cache: at
temperature 0 the answer is the same). Call finish() when the reply should not be shared any more
(stopped, flagged, failed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from fairway.limits import _redis
from fairway.limits.errors import LimitsUnavailable
from fairway.redis_client import RedisClient, Script

PENDING_TTL_S = 30.0  # longest a leader may take to start a reply before others stop waiting on it


def is_cacheable(temperature: float | None, n: int | None = 1) -> bool:
    """Only explicitly greedy single-choice requests: OpenAI's default temperature is 1."""
    return temperature is not None and float(temperature) == 0.0 and (n or 1) == 1


def flight_fingerprint(scope: str, model: str, messages: Sequence[Mapping[str, Any]],
                       **params: Any) -> str:
    """Key of a cacheable request. `scope` decides who may share: a user id keeps flights within one
    user (they may stop or resume the shared reply); "global" shares across users, which then must
    only read it. `params` are whatever else changes the output (max_tokens, stop, seed, tools)."""
    canonical = json.dumps([scope, model, list(messages), params], sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Flight:
    reply_id: str
    leader: bool  # True: this caller started the reply (and may finish() the flight)


class SingleFlight(ABC):
    def __init__(self, ttl_s: float = 120.0, wait_s: float = 10.0, pending_ttl_s: float = PENDING_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.pending_ttl_s = pending_ttl_s

    async def run(self, fingerprint: str, start: Callable[[], Awaitable[str]],
                  wait_s: float | None = None) -> Flight:
        """The reply id for this request: from the flight in progress, or from start() (which must
        create the reply and return its id) when this caller leads. If the leader fails, one of the
        waiting followers leads next; a follower that waits past wait_s starts its own reply
        rather than fail (a duplicate generation is the worst case, never an error)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.wait_s if wait_s is None else wait_s)
        attempt = 0
        while True:
            token = uuid.uuid4().hex
            if await self._lead(fingerprint, token):
                try:
                    reply_id = await start()
                except BaseException:
                    await asyncio.shield(self._abandon(fingerprint, token))
                    raise
                with suppress(LimitsUnavailable):  # the reply runs; followers time out to their own
                    await self._publish(fingerprint, token, reply_id)
                return Flight(reply_id, leader=True)
            value = await self._peek(fingerprint)
            if value is not None and value.startswith("reply:"):
                return Flight(value.removeprefix("reply:"), leader=False)
            left = deadline - loop.time()
            if value is not None and left <= 0:
                return Flight(await start(), leader=True)  # uncoordinated, not published
            if value is not None:
                await self._wait(fingerprint, left, attempt)
                attempt += 1
            # value None: the key vanished between our SET NX and GET (leader gave up): lead now

    async def lookup(self, fingerprint: str) -> str | None:
        value = await self._peek(fingerprint)
        return value.removeprefix("reply:") if value and value.startswith("reply:") else None

    @abstractmethod
    async def finish(self, fingerprint: str, reply_id: str) -> None:
        """Stop sharing this reply (only if the flight still names it)."""

    # -- primitives ------------------------------------------------------------------------------

    @abstractmethod
    async def _lead(self, fingerprint: str, token: str) -> bool: ...

    @abstractmethod
    async def _publish(self, fingerprint: str, token: str, reply_id: str) -> None: ...

    @abstractmethod
    async def _abandon(self, fingerprint: str, token: str) -> None: ...

    @abstractmethod
    async def _peek(self, fingerprint: str) -> str | None: ...

    @abstractmethod
    async def _wait(self, fingerprint: str, timeout: float, attempt: int) -> None:
        """Return when the flight may have changed, or after timeout."""

    async def close(self) -> None:
        return None


@dataclass
class _Flight:
    value: str
    expires: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class InProcessSingleFlight(SingleFlight):
    def __init__(self, ttl_s: float = 120.0, wait_s: float = 10.0, pending_ttl_s: float = PENDING_TTL_S,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(ttl_s, wait_s, pending_ttl_s)
        self._clock = clock or time.monotonic
        self._flights: dict[str, _Flight] = {}
        self._last_sweep = self._clock()

    def _get(self, fingerprint: str) -> _Flight | None:
        now = self._clock()
        if now - self._last_sweep > self.ttl_s:  # bounded by the number of flights in one TTL
            self._last_sweep = now
            self._flights = {k: f for k, f in self._flights.items() if f.expires > now}
        flight = self._flights.get(fingerprint)
        if flight is not None and flight.expires <= now:
            self._drop(fingerprint)
            return None
        return flight

    def _drop(self, fingerprint: str) -> None:
        flight = self._flights.pop(fingerprint, None)
        if flight is not None:
            flight.changed.set()

    async def _lead(self, fingerprint: str, token: str) -> bool:
        if self._get(fingerprint) is not None:
            return False
        self._flights[fingerprint] = _Flight(f"pending:{token}", self._clock() + self.pending_ttl_s)
        return True

    async def _publish(self, fingerprint: str, token: str, reply_id: str) -> None:
        flight = self._get(fingerprint)
        if flight is not None and flight.value == f"pending:{token}":
            self._flights[fingerprint] = _Flight(f"reply:{reply_id}", self._clock() + self.ttl_s)
            flight.changed.set()

    async def _abandon(self, fingerprint: str, token: str) -> None:
        flight = self._get(fingerprint)
        if flight is not None and flight.value == f"pending:{token}":
            self._drop(fingerprint)

    async def _peek(self, fingerprint: str) -> str | None:
        flight = self._get(fingerprint)
        return None if flight is None else flight.value

    async def _wait(self, fingerprint: str, timeout: float, attempt: int) -> None:
        flight = self._get(fingerprint)
        if flight is not None:
            try:
                async with asyncio.timeout(min(timeout, max(0.0, flight.expires - self._clock()))):
                    await flight.changed.wait()
            except TimeoutError:
                pass

    async def finish(self, fingerprint: str, reply_id: str) -> None:
        flight = self._get(fingerprint)
        if flight is not None and flight.value == f"reply:{reply_id}":
            self._drop(fingerprint)


# KEYS: flight. ARGV: expected value, new value ('' = delete), ttl_ms. Compare-and-set.
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""


class RedisSingleFlight(SingleFlight):
    """Followers on other gateways poll (10 ms doubling to 100 ms) for the leader's reply id: a
    follower waits once per flight, for about the time it takes to create a reply."""

    def __init__(self, client: RedisClient, ttl_s: float = 120.0, wait_s: float = 10.0,
                 pending_ttl_s: float = PENDING_TTL_S, prefix: str = "fairway:") -> None:
        super().__init__(ttl_s, wait_s, pending_ttl_s)
        self._r = client
        self._prefix = prefix
        self._swap = Script(_SWAP)

    def _key(self, fingerprint: str) -> str:
        return f"{self._prefix}flight:{fingerprint}"

    def _ms(self, seconds: float) -> int:
        return max(1, int(seconds * 1000))

    async def _lead(self, fingerprint: str, token: str) -> bool:
        with _redis.guard():
            return bool(await self._r.execute("SET", self._key(fingerprint), f"pending:{token}", "NX", "PX",
                                              self._ms(self.pending_ttl_s)))

    async def _publish(self, fingerprint: str, token: str, reply_id: str) -> None:
        with _redis.guard():
            await _redis.run(self._r, self._swap, [self._key(fingerprint)],
                             [f"pending:{token}", f"reply:{reply_id}", self._ms(self.ttl_s)])

    async def _abandon(self, fingerprint: str, token: str) -> None:
        with _redis.guard():
            await _redis.run(self._r, self._swap, [self._key(fingerprint)], [f"pending:{token}", "", 0])

    async def _peek(self, fingerprint: str) -> str | None:
        with _redis.guard():
            return await self._r.execute("GET", self._key(fingerprint))

    async def _wait(self, fingerprint: str, timeout: float, attempt: int) -> None:
        await asyncio.sleep(min(0.01 * 2 ** min(attempt, 4), 0.1, timeout))

    async def finish(self, fingerprint: str, reply_id: str) -> None:
        with _redis.guard():
            await _redis.run(self._r, self._swap, [self._key(fingerprint)], [f"reply:{reply_id}", "", 0])
