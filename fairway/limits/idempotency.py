"""Idempotency keys (X-Idempotency-Key): the first request with a key claims it; a duplicate finds
the reply the first one started and attaches to it instead of generating again.

Redis: SET NX on `{prefix}idempotency:{user}:{key}` with a TTL (one atomic claim-or-read script),
the value a small JSON {f: body fingerprint, r: reply id, s: state, t: TTL once attached, ms}. In
process: a dict with expiry times. States: claimed (no reply yet) -> running (attach) -> complete.

A claim is provisional: it lives claim_ttl_s (a minute) until attach() names its reply, and only
then the key's full TTL (a day). A claimant that never gets to attach or release (its gateway died,
or the store failed under both its start and its release) would otherwise hold the key a whole
day, every retry with it waiting and then refused as "still being started".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from fairway.limits import _redis
from fairway.redis_client import RedisClient, Script

MAX_KEY_LENGTH = 255
DEFAULT_TTL_S = 24 * 3600.0
# Claim to attach is one turn's start (checks, context, routing, one store write): well under this.
DEFAULT_CLAIM_TTL_S = 60.0

IdempotencyState = Literal["claimed", "running", "complete"]


def body_fingerprint(body: Any) -> str:
    """sha256 of the canonical JSON of a parsed body (key order and spacing do not matter)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_key(key: str) -> None:
    """The gateway answers 400 for these (param: the X-Idempotency-Key header)."""
    if not key:
        raise ValueError("idempotency key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"idempotency key is {len(key)} characters; at most {MAX_KEY_LENGTH} are allowed")


@dataclass(frozen=True)
class Claimed:
    """This request owns the key: run it, attach() its reply id, complete() at the end."""

    new: bool = True


@dataclass(frozen=True)
class Existing:
    """Someone claimed the key first."""

    reply_id: str | None  # None while the first request has not started its reply yet
    fingerprint: str
    state: IdempotencyState
    conflict: bool = False  # a different body under the same key: the gateway answers 409


class IdempotencyStore(ABC):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, claim_ttl_s: float = DEFAULT_CLAIM_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.claim_ttl_s = claim_ttl_s

    def _ttls(self, ttl_s: float | None) -> tuple[float, float]:
        """(how long the claim lives before attach, how long the key lives from attach)."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        return min(ttl, self.claim_ttl_s), ttl

    @abstractmethod
    async def claim(self, user: str, key: str, body_fingerprint: str,
                    ttl_s: float | None = None) -> Claimed | Existing:
        """Atomically claim the key, or say who has it. Raises ValueError for a bad key. The key
        lives claim_ttl_s until attach(), then ttl_s (default self.ttl_s) from the attach."""

    @abstractmethod
    async def attach(self, user: str, key: str, reply_id: str) -> bool:
        """Record the reply the claim started (claimed -> running), and keep the key its full TTL
        from now. False if the key is gone or already names another reply."""

    @abstractmethod
    async def complete(self, user: str, key: str) -> bool:
        """The reply ended: duplicates from now on get the finished reply. False if the key is gone."""

    @abstractmethod
    async def release(self, user: str, key: str) -> None:
        """Forget the key: the claimant failed before any reply (quota, overload, error), so a retry
        with the same key must be free to run."""

    @abstractmethod
    async def get(self, user: str, key: str, body_fingerprint: str | None = None) -> Existing | None: ...

    async def wait_for_reply(self, user: str, key: str, body_fingerprint: str | None = None,
                             timeout: float = 5.0) -> Existing | None:
        """For a duplicate that found the key claimed but no reply yet: poll until the first request
        attaches its reply (or completes). None when the key vanished (the first request released
        it: claim again); the last Existing, possibly still replyless, when `timeout` runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.01
        while True:
            existing = await self.get(user, key, body_fingerprint)
            if existing is None or existing.reply_id or existing.state != "claimed":
                return existing
            left = deadline - loop.time()
            if left <= 0:
                return existing
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)

    async def close(self) -> None:
        return None


def _existing(fingerprint: str, reply_id: str, state: str, asked: str | None) -> Existing:
    conflict = asked is not None and asked != fingerprint
    return Existing(reply_id or None, fingerprint, cast(IdempotencyState, state), conflict)


@dataclass
class _Entry:
    fingerprint: str
    expires: float
    ttl_s: float  # from attach on
    reply_id: str = ""
    state: str = "claimed"


class InProcessIdempotency(IdempotencyStore):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] | None = None,
                 claim_ttl_s: float = DEFAULT_CLAIM_TTL_S) -> None:
        super().__init__(ttl_s, claim_ttl_s)
        self._clock = clock or time.monotonic
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._last_sweep = self._clock()

    def _live(self, user: str, key: str) -> _Entry | None:
        check_key(key)
        now = self._clock()
        if now - self._last_sweep > 60.0:  # expired keys go within a minute of their TTL
            self._last_sweep = now
            self._entries = {k: e for k, e in self._entries.items() if e.expires > now}
        entry = self._entries.get((user, key))
        if entry is not None and entry.expires <= now:
            del self._entries[(user, key)]
            return None
        return entry

    async def claim(self, user: str, key: str, body_fingerprint: str,
                    ttl_s: float | None = None) -> Claimed | Existing:
        entry = self._live(user, key)  # no await until the dict is written: atomic on the loop
        if entry is not None:
            return _existing(entry.fingerprint, entry.reply_id, entry.state, body_fingerprint)
        claimed_s, ttl = self._ttls(ttl_s)
        self._entries[(user, key)] = _Entry(body_fingerprint, self._clock() + claimed_s, ttl)
        return Claimed()

    async def attach(self, user: str, key: str, reply_id: str) -> bool:
        if not reply_id:
            raise ValueError("reply_id must not be empty")
        entry = self._live(user, key)
        if entry is None:
            return False
        if entry.state != "claimed":
            return entry.reply_id == reply_id
        entry.reply_id, entry.state = reply_id, "running"
        entry.expires = self._clock() + entry.ttl_s
        return True

    async def complete(self, user: str, key: str) -> bool:
        entry = self._live(user, key)
        if entry is None:
            return False
        entry.state = "complete"
        return True

    async def release(self, user: str, key: str) -> None:
        check_key(key)
        self._entries.pop((user, key), None)

    async def get(self, user: str, key: str, body_fingerprint: str | None = None) -> Existing | None:
        entry = self._live(user, key)
        return None if entry is None else _existing(entry.fingerprint, entry.reply_id, entry.state,
                                                     body_fingerprint)


# KEYS: key. ARGV: value, ttl_ms. -> nil when claimed now, else the stored value.
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
return redis.call('GET', KEYS[1])
"""

# KEYS: key. ARGV: new state, reply id ('' = keep). Attaching (running) gives the key its full
# TTL, e.t ms, from now (a claim's value always has it); later updates keep that TTL.
_UPDATE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local e = cjson.decode(raw)
local attach = ARGV[1] == 'running'
if attach then
  if e.s ~= 'claimed' then return (e.r == ARGV[2]) and 1 or 0 end
  e.r = ARGV[2]
end
e.s = ARGV[1]
if attach and e.t then
  redis.call('SET', KEYS[1], cjson.encode(e), 'PX', e.t)
else
  redis.call('SET', KEYS[1], cjson.encode(e), 'KEEPTTL')
end
return 1
"""


class RedisIdempotency(IdempotencyStore):
    def __init__(self, client: RedisClient, ttl_s: float = DEFAULT_TTL_S, prefix: str = "fairway:",
                 claim_ttl_s: float = DEFAULT_CLAIM_TTL_S) -> None:
        super().__init__(ttl_s, claim_ttl_s)
        self._r = client
        self._prefix = prefix
        self._claim = Script(_CLAIM)
        self._update = Script(_UPDATE)

    def _key(self, user: str, key: str) -> str:
        check_key(key)
        return f"{self._prefix}idempotency:{_redis.part(user)}:{key}"

    async def claim(self, user: str, key: str, body_fingerprint: str,
                    ttl_s: float | None = None) -> Claimed | Existing:
        claimed_ms, ttl_ms = (max(1, int(s * 1000)) for s in self._ttls(ttl_s))
        value = json.dumps({"f": body_fingerprint, "r": "", "s": "claimed", "t": ttl_ms})
        with _redis.guard():
            raw = await _redis.run(self._r, self._claim, [self._key(user, key)], [value, claimed_ms])
        return Claimed() if raw is None else _decode(raw, body_fingerprint)

    async def attach(self, user: str, key: str, reply_id: str) -> bool:
        if not reply_id:
            raise ValueError("reply_id must not be empty")
        with _redis.guard():
            return bool(await _redis.run(self._r, self._update, [self._key(user, key)], ["running", reply_id]))

    async def complete(self, user: str, key: str) -> bool:
        with _redis.guard():
            return bool(await _redis.run(self._r, self._update, [self._key(user, key)], ["complete", ""]))

    async def release(self, user: str, key: str) -> None:
        with _redis.guard():
            await self._r.execute("DEL", self._key(user, key))

    async def get(self, user: str, key: str, body_fingerprint: str | None = None) -> Existing | None:
        with _redis.guard():
            raw = await self._r.execute("GET", self._key(user, key))
        return None if raw is None else _decode(raw, body_fingerprint)


def _decode(raw: str, asked: str | None) -> Existing:
    entry = json.loads(raw)
    return _existing(entry["f"], entry.get("r") or "", entry["s"], asked)
