"""RedisTokenLog: the at-scale backend, shared by every gateway and replica process.

Layout (the {reply id} hash tag keeps a reply's keys in one Redis Cluster slot, so the Lua
scripts below stay single-slot):

  {prefix}reply:{<id>}            Stream: header 0-1 from create(), event n at stream id n-0
  {prefix}reply:{<id>}:listeners  ZSET listener token -> heartbeat deadline (server time)
  {prefix}reply:{<id>}:listened   when a listener was last seen (server time)
  {prefix}reply:{<id>}:stop       stop flag
  {prefix}control                 Stream of stop requests, tailed by replicas (capped)
  {prefix}bus:{<queue>}:<lane>    List per lane; BLMPOP pops paid, free, background in order

Explicit stream ids make n the id: a replay "after n" is an exact range, and Redis itself rejects
a second event n, so a duplicate can never be stored. Live events reach all of a process's
subscribers through one shared blocking XREAD (_Tail), not one per subscriber. Every key carries a TTL refreshed by the
writes that matter, so retention needs no sweeper.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.relay.bus import DEFAULT_QUEUE, LANE_ORDER, ClaimedJob, Lane, decode_job, encode_job
from fairway.relay.errors import EventOutOfOrder, RelayUnavailable, ReplyFinished, ReplyNotFound
from fairway.relay.events import Event, FinalEvent, TokenEvent, event_from_fields
from fairway.relay.token_log import DEFAULT_TTL_S, LISTENER_STALE_S, TokenLog, check_after

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# KEYS: stream, listened. ARGV: ttl_ms. Header entry 0-1 lets an empty log exist (streams can't
# be empty otherwise) and sorts before event 1-0.
_CREATE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '0-1', 'k', 'open')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], string.format('%.6f', now), 'PX', ARGV[1])
return 1
"""
)

# KEYS: stream, listened. ARGV: n (0 = next), ttl_ms, kind, field/value pairs...
# Atomic check-and-append: the numbering rule holds even with two producers racing (failover).
_APPEND = (
    _NOW
    + """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = 0
if #top > 0 then
  last = tonumber(string.match(top[1][1], '^(%d+)-'))
  if top[1][2][2] == 'f' then return redis.error_reply('FAIRWAY_FINISHED ' .. last) end
else
  redis.call('SET', KEYS[2], string.format('%.6f', now), 'PX', ARGV[2], 'NX')
end
local n = tonumber(ARGV[1])
if n == 0 then n = last + 1 end
if n ~= last + 1 then return redis.error_reply('FAIRWAY_ORDER ' .. last) end
redis.call('XADD', KEYS[1], n .. '-0', 'k', ARGV[3], 'n', n, unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n
"""
)

# KEYS: listeners, listened. ARGV: token, ttl_ms, leaving ('1'/'0'), stale_s.
# The score is the deadline for the next heartbeat, set by the listener's own process, so how
# soon a silent listener counts as gone does not depend on who asks.
_HEARTBEAT = (
    _NOW
    + """
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
redis.call('SET', KEYS[2], string.format('%.6f', now), 'PX', ARGV[2])
return 1
"""
)

# KEYS: listeners, listened, stream. -> {count, listened_at|nil, now, exists}
# Dead gateways stop heartbeating; their listeners age out here instead of counting forever.
# (listened_at may then be up to one heartbeat old: the last time that listener was seen.)
_LISTENERS = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', now))
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2]), string.format('%.6f', now),
        redis.call('EXISTS', KEYS[3])}
"""
)

# KEYS: stream, stop. ARGV: ttl_ms. -> -1 unknown, 0 already ended, 1 stop pending.
_STOP = """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top == 0 then return -1 end
if top[1][2][2] == 'f' then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return 1
"""


@contextmanager
def _guard() -> Iterator[None]:
    """Turn transport failures into RelayUnavailable and our script errors into relay errors."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise RelayUnavailable(f"Redis unreachable: {exc}") from exc


def _script_error(exc: ResponseError, reply_id: str, n: int) -> Exception:
    code, _, last = str(exc).partition(" ")
    if code == "FAIRWAY_FINISHED":
        return ReplyFinished(reply_id, int(last))
    if code == "FAIRWAY_ORDER":
        return EventOutOfOrder(reply_id, n, int(last))
    return exc


def _n_of(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _events(entries: list[tuple[str, dict[str, str]]]) -> list[Event]:
    return [event_from_fields(fields) for _, fields in entries if fields.get("k") != "open"]


@dataclass(eq=False)
class _Subscriber:
    key: str
    cursor: int  # n of the last event handed to it
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # lists of events, or an exception


class _Tail:
    """Live events for every subscriber in this process: one blocking XREAD over all their streams
    on a connection of its own, instead of one XREAD per subscriber per event. Under load one call
    brings the events of many replies at once, so a gateway's Redis cost per event stays small.

    A new subscriber interrupts the blocked XREAD (CLIENT UNBLOCK) so its stream is read from the
    next call on. Multi-key XREAD needs one node: on Redis Cluster this would be one tail per node.
    """

    def __init__(self, make_client: Callable[[], aioredis.Redis], control: aioredis.Redis, block_ms: int) -> None:
        self._make_client = make_client
        self._control = control  # another connection, to send CLIENT UNBLOCK to this one
        self._block_ms = block_ms
        self._subscribers: dict[str, set[_Subscriber]] = {}
        self._task: asyncio.Task | None = None
        self._client_id: int | None = None
        self._generation = 0  # bumped by every new subscriber
        self._reading = -1  # the generation whose key set the XREAD in flight was built from
        self._blocked = False

    async def add(self, key: str, cursor: int) -> _Subscriber:
        sub = _Subscriber(key, cursor)
        self._subscribers.setdefault(key, set()).add(sub)
        self._generation += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="redis-token-log-tail")
        else:
            await self._wake(self._generation)
        return sub

    def remove(self, sub: _Subscriber) -> None:
        subs = self._subscribers.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subscribers[sub.key]

    async def _wake(self, generation: int) -> None:
        """Make sure the next XREAD includes the new stream: unblock the current one unless it was
        already built with it. A few quick retries cover an XREAD still on its way to Redis."""
        for _ in range(100):
            if self._reading >= generation or self._client_id is None:
                return
            if self._blocked:
                with _guard():
                    if await self._control.client_unblock(self._client_id):
                        return
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _run(self) -> None:
        client = self._make_client()
        try:
            self._client_id = int(await client.client_id())
            while self._subscribers:
                await self._read_once(client)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._fail_all(RelayUnavailable(f"Redis unreachable: {exc}"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave subscribers waiting on a dead tail
            self._fail_all(exc)
        finally:
            self._client_id = None
            self._blocked = False
            with suppress(Exception):
                await client.aclose()

    async def _read_once(self, client: aioredis.Redis) -> None:
        self._reading = self._generation
        cursors = {key: min(s.cursor for s in subs) for key, subs in self._subscribers.items()}
        # "{n}-1" sorts after event n (id n-0) and, for n = 0, after the header entry 0-1.
        streams = {key: f"{n}-1" for key, n in cursors.items()}
        self._blocked = True
        try:
            result = await client.xread(streams, block=self._block_ms, count=512)
        finally:
            self._blocked = False
        if not result:
            await self._drop_expired(client, list(cursors))
            return
        for key, entries in result:
            events = _events(entries)
            for sub in list(self._subscribers.get(key, ())):
                fresh = [e for e in events if e.n > sub.cursor]
                # A subscriber that joined while this XREAD was in flight may be behind the cursor
                # it was sent with: it gets nothing now, and the next XREAD starts from its cursor.
                if fresh and fresh[0].n == sub.cursor + 1:
                    sub.cursor = fresh[-1].n
                    sub.inbox.put_nowait(fresh)

    async def _drop_expired(self, client: aioredis.Redis, keys: list[str]) -> None:
        """A quiet round: tell the subscribers of logs that expired meanwhile."""
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            exists = await pipe.execute()
        for key, found in zip(keys, exists, strict=True):
            if not found:
                for sub in self._subscribers.pop(key, ()):
                    sub.inbox.put_nowait(ReplyNotFound(_reply_id_of(key)))

    def _fail_all(self, error: Exception) -> None:
        for subs in self._subscribers.values():
            for sub in subs:
                sub.inbox.put_nowait(error)
        self._subscribers.clear()


def _reply_id_of(key: str) -> str:
    return key[key.index("{") + 1 : key.rindex("}")]


class RedisTokenLog(TokenLog):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "fairway:",
        block_s: float = 1.0,
        heartbeat_s: float = 2.0,
        listener_stale_s: float = LISTENER_STALE_S,
        connect_timeout_s: float = 2.0,
        control_maxlen: int = 100_000,
    ) -> None:
        self.ttl_s = ttl_s
        self._prefix = prefix
        self._block_ms = max(1, int(block_s * 1000))  # one XREAD/BLMPOP wait; loops re-check state
        self._heartbeat_s = heartbeat_s
        self._stale_s = listener_stale_s
        self._control_maxlen = control_maxlen
        self._r = aioredis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=connect_timeout_s,
            # Must outlive the longest blocking command, or blocked reads would look like outages.
            socket_timeout=block_s + 5.0,
            # A couple of quick retries ride out a blip; beyond that callers get RelayUnavailable.
            retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 2),
        )
        def tail_client() -> aioredis.Redis:
            # One connection, no retries: an XREAD that CLIENT UNBLOCK targets must stay on it.
            return aioredis.from_url(
                url,
                decode_responses=True,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=block_s + 5.0,
                single_connection_client=True,
            )

        self._tail_reader = _Tail(tail_client, self._r, self._block_ms)
        self._create = self._r.register_script(_CREATE)
        self._append = self._r.register_script(_APPEND)
        self._heartbeat = self._r.register_script(_HEARTBEAT)
        self._listeners = self._r.register_script(_LISTENERS)
        self._stop = self._r.register_script(_STOP)

    # -- keys --------------------------------------------------------------------------------

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def _key(self, reply_id: str, part: str = "") -> str:
        return f"{self._prefix}reply:{{{reply_id}}}{':' + part if part else ''}"

    def _lane_key(self, queue: str, lane: Lane) -> str:
        return f"{self._prefix}bus:{{{queue}}}:{lane}"

    @property
    def _control_key(self) -> str:
        return f"{self._prefix}control"

    async def ping(self) -> None:
        """Fail fast at startup with RelayUnavailable rather than on the first reply."""
        with _guard():
            await self._r.ping()

    async def close(self) -> None:
        await self._tail_reader.close()
        await self._r.aclose()

    # -- the log -----------------------------------------------------------------------------

    async def create(self, reply_id: str) -> bool:
        with _guard():
            keys = [self._key(reply_id), self._key(reply_id, "listened")]
            return bool(await self._create(keys=keys, args=[self._ttl_ms]))

    async def append(self, reply_id: str, event: TokenEvent) -> int:
        if not isinstance(event, TokenEvent):
            raise TypeError("append() takes a TokenEvent; use finish() for the terminal event")
        return await self._add(reply_id, event)

    async def finish(self, reply_id: str, final: FinalEvent) -> int:
        if not isinstance(final, FinalEvent):
            raise TypeError("finish() takes a FinalEvent")
        return await self._add(reply_id, final)

    async def _add(self, reply_id: str, event: Event) -> int:
        fields = event.to_fields()
        kind = fields.pop("k")
        fields.pop("n")  # the script writes the n it assigned or validated
        flat = [item for pair in fields.items() for item in pair]
        keys = [self._key(reply_id), self._key(reply_id, "listened")]
        with _guard():
            try:
                return int(await self._append(keys=keys, args=[event.n, self._ttl_ms, kind, *flat]))
            except ResponseError as exc:
                raise _script_error(exc, reply_id, event.n) from exc

    async def _snapshot(self, reply_id: str, after: int) -> tuple[list[Event], bool]:
        """Validated events after `after` and whether the log has ended, read atomically
        (MULTI/EXEC) so the two agree."""
        key = self._key(reply_id)
        with _guard():
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.xrevrange(key, "+", "-", count=1)
                pipe.xrange(key, min=f"{after + 1}-0", max="+")
                top, entries = await pipe.execute()
        if not top:
            raise ReplyNotFound(reply_id)
        top_id, top_fields = top[0]
        finished = top_fields.get("k") == "f"
        check_after(reply_id, after, _n_of(top_id), finished)
        return _events(entries), finished

    async def read(self, reply_id: str, after: int = 0) -> list[Event]:
        events, _ = await self._snapshot(reply_id, after)
        return events

    async def subscribe(self, reply_id: str, after: int = 0) -> AsyncIterator[Event]:
        replay, finished = await self._snapshot(reply_id, after)
        if finished and not replay:
            return  # the cursor is at the terminal event already: nothing will follow
        token = uuid.uuid4().hex
        await self._beat(reply_id, token)  # counted before the first event is handed out
        beating = asyncio.create_task(self._keep_beating(reply_id, token))
        try:
            cursor = after
            for event in replay:
                yield event
                cursor = event.n
                if isinstance(event, FinalEvent):
                    return
            async with aclosing(self._tail(reply_id, cursor)) as live:
                async for event in live:
                    yield event
                    if isinstance(event, FinalEvent):
                        return
        finally:
            beating.cancel()
            with suppress(Exception):  # best effort: a stale heartbeat ages out anyway
                await self._beat(reply_id, token, leaving=True)

    async def _tail(self, reply_id: str, cursor: int) -> AsyncIterator[Event]:
        """Live events after n = cursor, from the shared tail. The stream id cursor makes the
        replay->live seam exact."""
        sub = await self._tail_reader.add(self._key(reply_id), cursor)
        try:
            while True:
                batch = await sub.inbox.get()
                if isinstance(batch, Exception):
                    raise batch
                for event in batch:
                    yield event
        finally:
            self._tail_reader.remove(sub)

    async def _beat(self, reply_id: str, token: str, leaving: bool = False) -> None:
        keys = [self._key(reply_id, "listeners"), self._key(reply_id, "listened")]
        with _guard():
            await self._heartbeat(
                keys=keys, args=[token, self._ttl_ms, "1" if leaving else "0", self._stale_s]
            )

    async def _keep_beating(self, reply_id: str, token: str) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            with suppress(RelayUnavailable):  # keep trying; the stream read reports the outage
                await self._beat(reply_id, token)

    async def exists(self, reply_id: str) -> bool:
        with _guard():
            return bool(await self._r.exists(self._key(reply_id)))

    async def last_event_id(self, reply_id: str) -> int:
        with _guard():
            top = await self._r.xrevrange(self._key(reply_id), "+", "-", count=1)
        if not top:
            raise ReplyNotFound(reply_id)
        return _n_of(top[0][0])

    # -- listeners ---------------------------------------------------------------------------

    async def _listener_state(self, reply_id: str) -> tuple[int, float | None, float, bool]:
        keys = [self._key(reply_id, "listeners"), self._key(reply_id, "listened"), self._key(reply_id)]
        with _guard():
            count, listened, now, exists = await self._listeners(keys=keys, args=[])
        return int(count), float(listened) if listened else None, float(now), bool(exists)

    async def listener_count(self, reply_id: str) -> int:
        count, _, _, exists = await self._listener_state(reply_id)
        return count if exists else 0

    async def last_listened_at(self, reply_id: str) -> float | None:
        count, listened, now, exists = await self._listener_state(reply_id)
        if not exists:
            return None
        return now if count else listened

    async def listener_idle_s(self, reply_id: str) -> float | None:
        count, listened, now, exists = await self._listener_state(reply_id)
        if not exists or listened is None:
            return None
        return 0.0 if count else max(0.0, now - listened)

    # -- control -----------------------------------------------------------------------------

    async def request_stop(self, reply_id: str) -> bool:
        keys = [self._key(reply_id), self._key(reply_id, "stop")]
        with _guard():
            outcome = int(await self._stop(keys=keys, args=[self._ttl_ms]))
            if outcome < 0:
                raise ReplyNotFound(reply_id)
            if outcome == 0:
                return False
            # Flag first, then notify: a watcher that misses the notice still finds the flag. The
            # control stream lives in another cluster slot, hence a separate command.
            await self._r.xadd(
                self._control_key,
                {"op": "stop", "reply": reply_id},
                maxlen=self._control_maxlen,
                approximate=True,
            )
        return True

    async def stop_requested(self, reply_id: str) -> bool:
        with _guard():
            return bool(await self._r.exists(self._key(reply_id, "stop")))

    async def watch_stops(self) -> AsyncIterator[str]:
        with _guard():
            top = await self._r.xrevrange(self._control_key, "+", "-", count=1)
        cursor = top[0][0] if top else "0-0"  # an explicit id, not "$": nothing slips in between calls
        while True:
            with _guard():
                result = await self._r.xread({self._control_key: cursor}, block=self._block_ms, count=512)
            for entry_id, fields in result[0][1] if result else []:
                cursor = entry_id
                if fields.get("op") == "stop":
                    yield fields["reply"]

    # -- reply bus ---------------------------------------------------------------------------

    async def submit(
        self,
        job: dict[str, Any],
        lane: Lane | str = Lane.FREE,
        *,
        queue: str = DEFAULT_QUEUE,
        front: bool = False,
    ) -> str:
        lane = Lane(lane)
        job_id = uuid.uuid4().hex
        raw = encode_job(job_id, job)
        key = self._lane_key(queue, lane)
        with _guard():
            await (self._r.lpush(key, raw) if front else self._r.rpush(key, raw))
        return job_id

    async def claim(self, *, queue: str = DEFAULT_QUEUE, timeout: float | None = 0.0) -> ClaimedJob | None:
        keys = [self._lane_key(queue, lane) for lane in LANE_ORDER]  # (B)LMPOP takes the first non-empty
        lanes = dict(zip(keys, LANE_ORDER, strict=True))
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            with _guard():
                if remaining is not None and remaining <= 0:
                    popped = await self._r.lmpop(len(keys), *keys, direction="LEFT")
                else:
                    # Wait in slices no longer than block_s so the socket timeout never fires.
                    wait = (
                        self._block_ms / 1000 if remaining is None else min(remaining, self._block_ms / 1000)
                    )
                    popped = await self._r.blmpop(max(wait, 0.01), len(keys), *keys, direction="LEFT")
            if popped:
                key, items = popped
                return decode_job(items[0], lanes[key])
            if remaining is not None and remaining <= 0:
                return None

    async def queue_depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        with _guard():
            async with self._r.pipeline(transaction=False) as pipe:
                for lane in LANE_ORDER:
                    pipe.llen(self._lane_key(queue, lane))
                depths = await pipe.execute()
        return dict(zip(LANE_ORDER, (int(d) for d in depths), strict=True))
