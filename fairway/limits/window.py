"""Sliding-window counters: the core that token quotas and request rates share.

A window of W seconds is split into N buckets (60 x 1 s by default). Each key holds
{bucket index -> amount}; the usage is the sum of the live buckets (the last N), so a check costs
O(N) whatever the traffic, and a key left alone simply ages out: a gateway that dies between
reserve and settle leaks nothing past one window. Exact to one bucket (1 s).

Backends: InProcessWindow (a dict; every method runs without an await between check and write,
so on the one event loop thread it is a lock-free critical section) and RedisWindow (one Lua
script per operation on one key: atomic across any number of gateways, and Cluster-safe).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from fairway.limits import _redis
from fairway.limits.errors import LimitsUnavailable
from fairway.redis_client import RedisClient, Script

LimitType = Literal["tokens", "requests"]


@dataclass(frozen=True)
class WindowState:
    limit: int
    used: int
    reset_s: float  # until the window is empty again: OpenAI's "resets to its initial state"

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class Added:
    """Outcome of one atomic check-and-add."""

    ok: bool
    state: WindowState  # after the add when ok, else as it stands
    bucket: int  # where the amount went: settle/release adjust this same bucket
    retry_after: float  # seconds until `amount` would fit (0 when ok; window_s if it never fits)


@dataclass(frozen=True)
class Denied:
    """Over a limit. The gateway answers 429 (type `tokens`/`requests`, code `rate_limit_exceeded`)."""

    type: LimitType
    limit: int
    used: int
    requested: int
    retry_after: float  # seconds
    scope: str  # "user:model" (tokens), "user" or "ip" (requests)
    state: WindowState  # the window that refused: its x-ratelimit-* headers on the 429
    subject: str = ""  # the model (tokens) or the IP, for the message

    @property
    def too_large(self) -> bool:
        """The request alone exceeds the limit: no wait helps (OpenAI's "Request too large")."""
        return self.requested > self.limit

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))

    def message(self) -> str:
        what = "tokens per min (TPM)" if self.type == "tokens" else "requests per min (RPM)"
        where = f" for {self.subject}" if self.subject else ""
        head = "Request too large" if self.too_large else "Rate limit reached"
        tail = ("Reduce the prompt or max_tokens." if self.too_large
                else f"Please try again in {self.retry_after:.3g}s.")
        return (f"{head}{where} on {what}: Limit {self.limit}, Used {self.used}, "
                f"Requested {self.requested}. {tail}")


class WindowCounter(ABC):
    """One small interface, two backends. `key` is already namespaced by the caller."""

    # When the store last failed (time.monotonic()): a best-effort read (the headers of a response
    # that did not need the limits) skips it for a moment rather than wait out its timeout again.
    failed_at: float = -math.inf

    def __init__(self, window_s: float, buckets: int) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self.window_s = window_s
        self.buckets = buckets
        self.bucket_s = window_s / buckets

    @abstractmethod
    async def add(self, key: str, amount: int, limit: int) -> Added:
        """Add `amount` now iff usage + amount <= limit, in one atomic step."""

    async def add_many(self, adds: Sequence[tuple[str, int, int]]) -> list[Added]:
        """add(key, amount, limit) for each, every one atomic on its own (their keys may live on
        different Redis Cluster nodes); one round trip for all on Redis."""
        return [await self.add(key, amount, limit) for key, amount, limit in adds]

    @abstractmethod
    async def adjust(self, key: str, bucket: int, delta: int) -> None:
        """Change an earlier add (settle, release, refund). A bucket that has left the window is
        not touched: its amount no longer counts anyway."""

    async def state(self, key: str, limit: int) -> WindowState:
        return (await self.add(key, 0, limit)).state

    async def close(self) -> None:
        return None


def evaluate(live: dict[int, int], now: float, amount: int, limit: int, n: int, bucket_s: float,
             window_s: float) -> tuple[bool, int, float]:
    """(fits, used, retry_after) over live buckets; the same arithmetic as the Lua below.
    A bucket b counts until the clock reaches bucket b + n, i.e. time (b + n) * bucket_s."""
    used = sum(live.values())
    fits = used + amount <= limit
    retry = 0.0
    if not fits:
        retry = window_s  # never fits: any wait is as good as another
        if amount <= limit:
            need, freed = used + amount - limit, 0
            for b in sorted(live):
                freed += live[b]
                if freed >= need:
                    retry = max(0.0, (b + n) * bucket_s - now)
                    break
    return fits, used, retry


def reset_after(live: dict[int, int], now: float, n: int, bucket_s: float) -> float:
    return max(0.0, (max(live) + n) * bucket_s - now) if live else 0.0


class InProcessWindow(WindowCounter):
    def __init__(self, window_s: float = 60.0, buckets: int = 60,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(window_s, buckets)
        self._clock = clock or time.monotonic
        self._keys: dict[str, dict[int, int]] = {}
        self._last_sweep = self._clock()

    def _live(self, key: str, now: float) -> dict[int, int]:
        oldest = math.floor(now / self.bucket_s) - self.buckets + 1
        counts = self._keys.setdefault(key, {})
        for b in [b for b, v in counts.items() if b < oldest or v <= 0]:
            del counts[b]
        return counts

    def _sweep(self, now: float) -> None:
        # Idle users' keys would otherwise stay forever: drop empty ones once a window.
        if now - self._last_sweep < self.window_s:
            return
        self._last_sweep = now
        for key in list(self._keys):
            if not self._live(key, now):
                del self._keys[key]

    async def add(self, key: str, amount: int, limit: int) -> Added:
        # No await from here to the end: nothing can interleave between the check and the write.
        now = self._clock()
        self._sweep(now)
        live = self._live(key, now)
        bucket = math.floor(now / self.bucket_s)
        fits, used, retry = evaluate(live, now, amount, limit, self.buckets, self.bucket_s, self.window_s)
        if fits and amount > 0:
            live[bucket] = live.get(bucket, 0) + amount
            used += amount
        if not live:
            del self._keys[key]
        return Added(fits, WindowState(limit, used, reset_after(live, now, self.buckets, self.bucket_s)),
                     bucket, retry)

    async def adjust(self, key: str, bucket: int, delta: int) -> None:
        now = self._clock()
        live = self._live(key, now)
        if bucket >= math.floor(now / self.bucket_s) - self.buckets + 1:
            live[bucket] = live.get(bucket, 0) + delta
            if live[bucket] <= 0:
                del live[bucket]
        if not live:
            del self._keys[key]


# KEYS: the hash. ARGV: amount, limit, bucket_s, n, ttl_ms, now ('' = server TIME).
# -> {ok, used, bucket, retry_after (string), reset_s (string)}: Lua numbers come back as
# integers, so the fractional ones travel as strings.
_ADD = _redis.now_from(6) + """
local amount = tonumber(ARGV[1]); local limit = tonumber(ARGV[2])
local bs = tonumber(ARGV[3]); local n = tonumber(ARGV[4])
local cur = math.floor(now / bs)
local oldest = cur - n + 1
local flat = redis.call('HGETALL', KEYS[1])
local live = {}
local used = 0
local newest = nil
for i = 1, #flat, 2 do
  local b = tonumber(flat[i]); local v = tonumber(flat[i + 1])
  if b < oldest or v <= 0 then
    redis.call('HDEL', KEYS[1], flat[i])
  else
    used = used + v
    live[#live + 1] = {b, v}
    if newest == nil or b > newest then newest = b end
  end
end
local ok = used + amount <= limit
local retry = 0
if not ok then
  retry = n * bs
  if amount <= limit then
    table.sort(live, function(x, y) return x[1] < y[1] end)
    local need = used + amount - limit
    local freed = 0
    for _, bv in ipairs(live) do
      freed = freed + bv[2]
      if freed >= need then retry = math.max(0, (bv[1] + n) * bs - now); break end
    end
  end
elseif amount > 0 then
  redis.call('HINCRBY', KEYS[1], string.format('%d', cur), amount)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  used = used + amount
  if newest == nil or cur > newest then newest = cur end
end
local reset = 0
if newest ~= nil then reset = math.max(0, (newest + n) * bs - now) end
return {ok and 1 or 0, used, cur, string.format('%.6f', retry), string.format('%.6f', reset)}
"""

# KEYS: the hash. ARGV: bucket, delta, bucket_s, n, now ('' = server TIME).
_ADJUST = _redis.now_from(5) + """
local b = tonumber(ARGV[1])
if b < math.floor(now / tonumber(ARGV[3])) - tonumber(ARGV[4]) + 1 then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local v = redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
if v <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 1
"""


class RedisWindow(WindowCounter):
    """Checked on every chat request: one pipelined round trip for all of a request's windows."""

    def __init__(self, client: RedisClient, window_s: float = 60.0, buckets: int = 60,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(window_s, buckets)
        self._client = client
        self._clock = clock
        self._add = Script(_ADD)
        self._adjust = Script(_ADJUST)
        # The hash outlives its newest bucket by a margin, then Redis drops it: no sweeper.
        self._ttl_ms = int((window_s + self.bucket_s) * 1000) + 1000

    async def add(self, key: str, amount: int, limit: int) -> Added:
        return (await self.add_many([(key, amount, limit)]))[0]

    async def add_many(self, adds: Sequence[tuple[str, int, int]]) -> list[Added]:
        clock, bucket_s = _redis.clock_arg(self._clock), repr(self.bucket_s)
        calls = [([key], [amount, limit, bucket_s, self.buckets, self._ttl_ms, clock]) for key, amount, limit in adds]
        with self._guard():
            results = await self._client.run_scripts(self._add, calls)
        added = []
        for (_, _, limit), result in zip(adds, results, strict=True):
            if isinstance(result, Exception):
                raise result
            ok, used, bucket, retry, reset = result
            added.append(Added(bool(ok), WindowState(limit, int(used), float(reset)), int(bucket), float(retry)))
        return added

    async def adjust(self, key: str, bucket: int, delta: int) -> None:
        if delta == 0:
            return
        args = [bucket, delta, repr(self.bucket_s), self.buckets, _redis.clock_arg(self._clock)]
        with self._guard():
            await _redis.run(self._client, self._adjust, [key], args)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            with _redis.guard():
                yield
        except LimitsUnavailable:
            self.failed_at = time.monotonic()
            raise
