"""RedisTokenLog: the at-scale backend, shared by every gateway and replica process.

Layout (the {reply id} hash tag keeps a reply's keys in one Redis Cluster slot, so the Lua
scripts below stay single-slot):

  {prefix}reply:{<id>}            Stream: header 0-1 from create(), event n at stream id n-0
  {prefix}reply:{<id>}:live       shard channel: each event as it is appended (SPUBLISH)
  {prefix}reply:{<id>}:listeners  ZSET listener token -> heartbeat deadline (server time)
  {prefix}reply:{<id>}:listened   when a listener was last seen (server time)
  {prefix}reply:{<id>}:stop       stop flag
  {prefix}control                 Stream of stop requests, tailed by replicas (capped)
  {prefix}bus:{<queue>}:<lane>    List per lane; BLMPOP pops paid, free, background in order

Explicit stream ids make n the id: a replay "after n" is an exact range, and Redis itself rejects
a second event n, so a duplicate can never be stored. Live events reach all of a process's
subscribers through one sharded Pub/Sub connection (redis_live.LiveEvents), the append script
publishing each event in the same atomic step that logs it. Per-process batching keeps the
round trips per event small: append_many() sends one engine step's events for all of a replica's
replies in one pipeline, and the heartbeats of all of a gateway's listeners go in one pipeline
per tick (_Heartbeats). Every key carries a TTL refreshed by the writes that matter, so retention
needs no sweeper.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.redis_mux import RedisMux, pack
from fairway.redis_pool import redis_client, run_packed_scripts, run_scripts, script_call
from fairway.relay.bus import DEFAULT_QUEUE, LANE_ORDER, ClaimedJob, Lane, decode_job, encode_job
from fairway.relay.errors import EventOutOfOrder, RelayError, RelayUnavailable, ReplyFinished, ReplyNotFound
from fairway.relay.events import Event, FinalEvent, TokenEvent, event_from_fields
from fairway.relay.inbox import Delivery
from fairway.relay.redis_live import LiveEvents, live_payload
from fairway.relay.token_log import (
    DEFAULT_TTL_S,
    LISTENER_STALE_S,
    TokenLog,
    TokenSink,
    check_after,
    check_token_events,
    raise_if_error,
)

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

# KEYS: stream, listened, live channel. ARGV: n (0 = next), ttl_ms, live payload, kind,
# field/value pairs... Atomic check-append-publish: the numbering rule holds even with two
# producers racing (failover), and an event is published exactly when it is logged.
_APPEND = """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = 0
if #top > 0 then
  last = tonumber(string.match(top[1][1], '^(%d+)-'))
  if top[1][2][2] == 'f' then return redis.error_reply('FAIRWAY_FINISHED ' .. last) end
else
  """ + _NOW + """
  redis.call('SET', KEYS[2], string.format('%.6f', now), 'PX', ARGV[2], 'NX')
end
local n = tonumber(ARGV[1])
if n == 0 then n = last + 1 end
if n ~= last + 1 then return redis.error_reply('FAIRWAY_ORDER ' .. last) end
redis.call('XADD', KEYS[1], n .. '-0', 'k', ARGV[4], 'n', n, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SPUBLISH', KEYS[3], n .. ' ' .. ARGV[3])
return n
"""

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


def _pairs(flat: list[str]) -> dict[str, str]:
    """A stream entry's fields as Redis sends them (f1, v1, f2, v2 ...)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _n_of(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


_INBOX_GROUP = "consumers"  # an inbox's one consumer group


def _delivery(entry_id: str, flat: list[str], attempts: int) -> Delivery:
    """An inbox stream entry as a Delivery; an entry that is not one of ours carries {} (its
    consumer refuses it, and acknowledges it so it does not come back)."""
    try:
        item = json.loads(_pairs(flat)["j"])
    except (KeyError, ValueError):
        item = {}
    return Delivery(entry_id, item if isinstance(item, dict) else {}, attempts)


def _events(entries: list[tuple[str, dict[str, str]]]) -> list[Event]:
    return [event_from_fields(fields) for _, fields in entries if fields.get("k") != "open"]


class _Heartbeats:
    """This process's listeners, as Redis counts them. Each joins and leaves with a call of its
    own, so it is counted before its first event and uncounted as soon as it leaves; in between all
    of them are refreshed together, one pipelined round trip per heartbeat_s, instead of a timer
    and a round trip per listener. A listener's refresh call is packed once, when it joins: at
    hundreds of listeners, building them anew each time cost more than the round trip."""

    def __init__(self, log: RedisTokenLog, heartbeat_s: float) -> None:
        self._log = log
        self._heartbeat_s = heartbeat_s
        self._listening: dict[str, bytes] = {}  # token -> its refresh call, packed
        self._task: asyncio.Task | None = None

    def joined(self, reply_id: str, token: str) -> None:
        """A listener counted by its first heartbeat (RedisTokenLog._snapshot's join): refreshed from now on."""
        self._listening[token] = self._log._beat_call(reply_id, token)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="redis-token-log-heartbeats")

    def forget(self, token: str) -> None:
        """No more refreshes: the listener ages out (listener_stale_s)."""
        self._listening.pop(token, None)

    async def leave(self, reply_id: str, token: str) -> None:
        """Best effort (a stale heartbeat ages out anyway), in a task of its own: a caller that is
        cancelled again meanwhile (a request's cancel scope at a client disconnect) cannot cut it short."""
        self._listening.pop(token, None)
        leaving = asyncio.ensure_future(self._leave(reply_id, token))
        _leaving.add(leaving)
        leaving.add_done_callback(_leaving.discard)
        await asyncio.shield(leaving)

    async def _leave(self, reply_id: str, token: str) -> None:
        with suppress(Exception):
            await self._log._beat([(reply_id, token)], leaving=True)

    async def _run(self) -> None:
        while self._listening:
            await asyncio.sleep(self._heartbeat_s)
            with suppress(RelayUnavailable):  # keep trying; the stream read reports the outage
                await self._log._beat_packed(list(self._listening.values()))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None


_leaving: set[asyncio.Task] = set()  # strong references: a leave in flight must not be collected

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
        max_connections: int = 64,
        consumer_gone_s: float = 3600.0,
    ) -> None:
        self.ttl_s = ttl_s
        self._prefix = prefix
        # One blocking XREAD/BLMPOP wait (loops re-check state), and how often live subscribers are
        # checked for idleness (keepalives) and expired logs.
        self._block_ms = max(1, int(block_s * 1000))
        self._stale_s = listener_stale_s
        self._control_maxlen = control_maxlen
        self._r = redis_client(
            url,
            max_connections=max_connections,
            wait_s=block_s + 5.0,
            connect_timeout_s=connect_timeout_s,
            # Must outlive the longest blocking command, or blocked reads would look like outages.
            socket_timeout_s=block_s + 5.0,
            # A couple of quick retries ride out a blip; beyond that callers get RelayUnavailable.
            retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 2),
        )
        # The commands of every request and every engine step (scripts, launch, snapshots) share
        # one multiplexed connection: a fraction of redis-py's CPU per command (redis_mux.py).
        self._mux = RedisMux(url, connect_timeout_s=connect_timeout_s, socket_timeout_s=block_s + 5.0, retries=2)
        # Blocking claims wait on connections of their own (a blocking read would hold up the
        # shared one), one per claim in progress, kept for the next: a BLMPOP there costs a tenth
        # of one through redis-py's pool, and a gateway's recorder makes two per reply.
        self._waiting_muxes: list[RedisMux] = []
        self._forget_consumers_at: dict[str, float] = {}  # per inbox key, loop time
        self._consumer_gone_s = consumer_gone_s
        self._new_waiting_mux = lambda: RedisMux(url, connect_timeout_s=connect_timeout_s,
                                                 socket_timeout_s=block_s + 5.0, retries=2)
        pool = self._r.connection_pool
        self._live = LiveEvents(pool, block_s, self._exist)
        self._heartbeats = _Heartbeats(self, heartbeat_s)
        self._create = self._r.register_script(_CREATE)
        self._append = self._r.register_script(_APPEND)
        # _token_call's first bytes: 14 parts, EVALSHA, the script, 3 keys.
        self._token_head = b"*14\r\n" + pack(["EVALSHA", self._append.sha, 3]).split(b"\r\n", 1)[1]
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
        await self._heartbeats.close()
        await self._live.close()
        await self._mux.close()
        for mux in self._waiting_muxes:
            await mux.close()
        self._waiting_muxes.clear()
        await self._r.aclose()

    async def _scripts(self, script: AsyncScript, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """run_scripts (one round trip for all calls), transport errors as RelayUnavailable."""
        with _guard():
            return await run_scripts(self._mux, script, calls)

    async def _exist(self, keys: list[str]) -> list[bool]:
        with _guard():
            async with self._r.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                return [bool(found) for found in await pipe.execute()]

    # -- the log -----------------------------------------------------------------------------

    def _create_keys(self, reply_id: str) -> list[str]:
        return [self._key(reply_id), self._key(reply_id, "listened")]

    async def create(self, reply_id: str) -> bool:
        with _guard():
            return bool(await self._create(keys=self._create_keys(reply_id), args=[self._ttl_ms]))

    async def append_many(self, items: Sequence[tuple[str, TokenEvent]]) -> list[int | Exception]:
        check_token_events(items)
        return await self._add(items)

    async def finish(self, reply_id: str, final: FinalEvent) -> int:
        if not isinstance(final, FinalEvent):
            raise TypeError("finish() takes a FinalEvent")
        return raise_if_error((await self._add([(reply_id, final)]))[0])

    async def _add(self, items: Sequence[tuple[str, Event]]) -> list[int | Exception]:
        calls = [self._token_call(reply_id, event) if isinstance(event, TokenEvent) else self._append_call(reply_id, event)
                 for reply_id, event in items]
        with _guard():
            results = await run_packed_scripts(self._mux, self._append, calls)
        return [_script_error(result, reply_id, event.n) if isinstance(result, ResponseError) else int(result)
                for (reply_id, event), result in zip(items, results, strict=True)]

    def _append_call(self, reply_id: str, event: Event) -> bytes:
        """The append script's call for any event."""
        fields = event.to_fields()
        kind = fields.pop("k")
        fields.pop("n")  # the script writes the n it assigned or validated
        flat = [item for pair in fields.items() for item in pair]
        keys = [self._key(reply_id), self._key(reply_id, "listened"), self._key(reply_id, "live")]
        return script_call(self._append, keys, [event.n, self._ttl_ms, live_payload(event), kind, *flat])

    def _token_call(self, reply_id: str, event: TokenEvent) -> bytes:
        """_append_call for a token, packed by hand (the same bytes): a replica sends one a token,
        and building the fields dict and packing each argument by type was most of its cost."""
        ids = ",".join(map(str, event.token_ids))
        text = event.text.encode()
        args = (self._key(reply_id).encode(), self._key(reply_id, "listened").encode(),
                self._key(reply_id, "live").encode(), str(event.n).encode(),
                str(self._ttl_ms).encode(), b"t%b\x1f%b" % (ids.encode(), text), b"t", b"text", text, b"ids",
                ids.encode())
        return self._token_head + b"".join([b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args])

    async def _snapshot(self, reply_id: str, after: int, join: str | None = None) -> tuple[list[Event], bool]:
        """Validated events after `after` and whether the log has ended, read atomically
        (MULTI/EXEC) so the two agree. With join (a listener's token), the listener is counted in
        the same round trip, right after the read."""
        key = self._key(reply_id)
        calls = [pack(["MULTI"]), pack(["XREVRANGE", key, "+", "-", "COUNT", 1]),
                 pack(["XRANGE", key, f"{after + 1}-0", "+"]), pack(["EXEC"])]
        if join is not None:
            calls.append(self._beat_call(reply_id, join))
        with _guard():
            results = await self._mux.batch_packed(calls)
        if join is not None and isinstance(results[4], NoScriptError):
            await self._beat([(reply_id, join)])  # (Redis lost the script: _beat reloads it)
        elif join is not None:
            raise_if_error(results[4])
        top, entries = (raise_if_error(part) for part in raise_if_error(results[3]))
        if not top:
            raise ReplyNotFound(reply_id)
        top_id, top_flat = top[0]
        finished = _pairs(top_flat).get("k") == "f"
        check_after(reply_id, after, _n_of(top_id), finished)
        return _events([(entry_id, _pairs(flat)) for entry_id, flat in entries]), finished

    async def read(self, reply_id: str, after: int = 0) -> list[Event]:
        events, _ = await self._snapshot(reply_id, after)
        return events

    async def subscribe_batches(
        self, reply_id: str, after: int = 0, idle_s: float | None = None, direct: TokenSink | None = None
    ) -> AsyncIterator[list[Event]]:
        # Subscribed before the log is read: every event is in the replay or heard live (or both).
        sub = await self._live.add(self._key(reply_id), self._key(reply_id, "live"), idle_s)
        try:
            # Counted as a listener before the first event is handed out, in the read's round trip.
            token = uuid.uuid4().hex
            try:
                replay, finished = await self._snapshot(reply_id, after, join=token)
            except RelayError:
                await self._heartbeats.leave(reply_id, token)  # (best effort, if it joined at all)
                raise
            self._heartbeats.joined(reply_id, token)
            ended = False  # at the final event: nobody needs this listener's leaving
            try:
                if finished and not replay:
                    ended = True
                    return  # the cursor is at the terminal event already: nothing will follow
                sub.cursor, batch = after, replay
                sub.direct = direct  # (only called while next_batch() waits)
                while True:
                    cursor = sub.cursor  # direct may have taken events since the last batch
                    fresh = batch
                    if batch and (batch[0].n != cursor + 1 or batch[-1].n != cursor + len(batch)):
                        fresh = [event for event in batch if event.n > cursor]  # the replay may hold the first live ones
                        if fresh and fresh[-1].n - cursor != len(fresh):
                            fresh = await self.read(reply_id, cursor)  # a gap (a lost message): the log has it all
                    if fresh:
                        sub.cursor = fresh[-1].n
                        if isinstance(fresh[-1], FinalEvent):
                            ended = True
                        yield fresh
                        if ended:
                            return
                    batch = await sub.next_batch()
                    if not batch:
                        yield []  # idle_s without events
            finally:
                # A listener that leaves a reply still running is uncounted at once (the idle timer
                # starts); one that saw the end just stops refreshing: only running replies' listeners
                # are ever counted, and its entry ages out with the others of a dead gateway.
                if ended:
                    self._heartbeats.forget(token)
                else:
                    await self._heartbeats.leave(reply_id, token)
        finally:
            self._live.remove(sub)

    async def _beat(self, listeners: list[tuple[str, str]], leaving: bool = False) -> None:
        """Heartbeats of (reply id, token) listeners, one round trip for all."""
        await self._beat_packed([self._beat_call(reply_id, token, leaving) for reply_id, token in listeners])

    def _beat_call(self, reply_id: str, token: str, leaving: bool = False) -> bytes:
        return script_call(self._heartbeat, [self._key(reply_id, "listeners"), self._key(reply_id, "listened")],
                           [token, self._ttl_ms, "1" if leaving else "0", self._stale_s])

    async def _beat_packed(self, calls: list[bytes]) -> None:
        with _guard():
            await run_packed_scripts(self._mux, self._heartbeat, calls)

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

    async def _listener_states(self, reply_ids: Sequence[str]) -> list[tuple[int, float | None, float, bool]]:
        calls = [([self._key(r, "listeners"), self._key(r, "listened"), self._key(r)], []) for r in reply_ids]
        states = []
        for result in await self._scripts(self._listeners, calls):
            count, listened, now, exists = raise_if_error(result)
            states.append((int(count), float(listened) if listened else None, float(now), bool(exists)))
        return states

    async def _listener_state(self, reply_id: str) -> tuple[int, float | None, float, bool]:
        return (await self._listener_states([reply_id]))[0]

    async def listener_count(self, reply_id: str) -> int:
        count, _, _, exists = await self._listener_state(reply_id)
        return count if exists else 0

    async def last_listened_at(self, reply_id: str) -> float | None:
        count, listened, now, exists = await self._listener_state(reply_id)
        if not exists:
            return None
        return now if count else listened

    async def listener_idle_s(self, reply_id: str) -> float | None:
        return (await self.listener_idle_many([reply_id]))[0]

    async def listener_idle_many(self, reply_ids: Sequence[str]) -> list[float | None]:
        return [None if not exists or listened is None else 0.0 if count else max(0.0, now - listened)
                for count, listened, now, exists in await self._listener_states(reply_ids)]

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
        job_id, key, raw = self._queued(job, lane, queue)
        with _guard():
            await (self._r.lpush(key, raw) if front else self._r.rpush(key, raw))
        return job_id

    def _queued(self, job: dict[str, Any], lane: Lane | str, queue: str) -> tuple[str, str, str]:
        """A new job's id, its lane's list and its encoding."""
        job_id = uuid.uuid4().hex
        return job_id, self._lane_key(queue, Lane(lane)), encode_job(job_id, job)

    async def launch(self, reply_id: str, job: dict[str, Any], lane: Lane | str = Lane.FREE, *,
                     queue: str = DEFAULT_QUEUE) -> str:
        # One pipeline, run in order: the log, then the job. EVAL, not EVALSHA: a script Redis
        # lost (NOSCRIPT) would fail the create while the job still went out.
        job_id, key, raw = self._queued(job, lane, queue)
        keys = self._create_keys(reply_id)
        with _guard():
            results = await self._mux.batch([["EVAL", self._create.script, len(keys), *keys, self._ttl_ms],
                                             ["RPUSH", key, raw]])
        for result in results:
            raise_if_error(result)
        return job_id

    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0) -> list[ClaimedJob]:
        keys = [self._lane_key(queue, lane) for lane in LANE_ORDER]  # (B)LMPOP takes the first non-empty
        lanes = dict(zip(keys, LANE_ORDER, strict=True))

        def claimed(popped: Any) -> list[ClaimedJob]:
            if not popped:
                return []
            key, items = popped
            return [decode_job(item, lanes[key]) for item in items]

        if timeout is not None and timeout <= 0:
            with _guard():
                return claimed(await self._mux.execute("LMPOP", len(keys), *keys, "LEFT", "COUNT", max_count))
        return claimed(await self._wait_for(
            lambda wait: ["BLMPOP", wait, len(keys), *keys, "LEFT", "COUNT", max_count], timeout))

    async def _wait_for(self, command: Callable[[float], list[Any]], timeout: float | None) -> Any:
        """Run a blocking command (command(seconds to wait) builds it) until it returns something
        or the timeout (None: no limit) runs out; None then. It waits on a connection of its own,
        in slices no longer than block_s so the socket timeout never fires."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None  # (the blocking read waited until the deadline)
            wait = self._block_ms / 1000 if remaining is None else min(remaining, self._block_ms / 1000)
            mux = self._waiting_muxes.pop() if self._waiting_muxes else self._new_waiting_mux()
            try:
                with _guard():
                    reply = await mux.execute(*command(max(wait, 0.01)))
            except BaseException:
                await mux.close()  # (cancelled mid-wait, its reply would come to the next caller)
                raise
            self._waiting_muxes.append(mux)
            if reply:
                return reply

    async def queue_depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        with _guard():
            async with self._r.pipeline(transaction=False) as pipe:
                for lane in LANE_ORDER:
                    pipe.llen(self._lane_key(queue, lane))
                depths = await pipe.execute()
        return dict(zip(LANE_ORDER, (int(d) for d in depths), strict=True))

    # -- inboxes (streams with one consumer group) -------------------------------------------

    def _inbox_key(self, inbox: str) -> str:
        return f"{self._prefix}inbox:{{{inbox}}}"

    async def post(self, inbox: str, item: dict[str, Any]) -> None:
        with _guard():
            await self._mux.execute("XADD", self._inbox_key(inbox), "*", "j", json.dumps(item, separators=(",", ":")))

    async def take(self, inbox: str, consumer: str, *, max_count: int,
                   timeout: float | None = 0.0) -> list[Delivery]:
        key = self._inbox_key(inbox)
        read = ["XREADGROUP", "GROUP", _INBOX_GROUP, consumer, "COUNT", max_count]
        for attempt in range(2):
            try:
                if timeout is not None and timeout <= 0:
                    with _guard():
                        reply = await self._mux.execute(*read, "STREAMS", key, ">")
                else:
                    reply = await self._wait_for(
                        lambda wait: [*read, "BLOCK", max(1, int(wait * 1000)), "STREAMS", key, ">"], timeout)
            except ResponseError as exc:
                # NOGROUP: first use, or a Redis that lost it (a restart); UNBLOCKED: the stream was
                # deleted under a blocked read.
                if attempt or not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                await self._create_group(key)
                continue
            return [_delivery(entry_id, flat, 1) for entry_id, flat in reply[0][1]] if reply else []
        raise AssertionError("unreachable")

    async def _create_group(self, key: str) -> None:
        # From the stream's start (0): items posted before the group existed are delivered too.
        with _guard():
            try:
                await self._mux.execute("XGROUP", "CREATE", key, _INBOX_GROUP, "0", "MKSTREAM")
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):  # (another consumer made it meanwhile)
                    raise

    async def ack(self, inbox: str, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        key, ids = self._inbox_key(inbox), [d.id for d in deliveries]
        with _guard():
            for result in await self._mux.batch([["XACK", key, _INBOX_GROUP, *ids], ["XDEL", key, *ids]]):
                raise_if_error(result)

    async def reclaim(self, inbox: str, consumer: str, *, min_idle_s: float,
                      max_count: int) -> list[Delivery]:
        key, idle_ms = self._inbox_key(inbox), max(0, int(min_idle_s * 1000))
        with _guard():
            try:
                pending = await self._mux.execute("XPENDING", key, _INBOX_GROUP, "IDLE", idle_ms, "-", "+", max_count)
            except ResponseError as exc:
                if str(exc).startswith("NOGROUP"):
                    return []  # nothing was ever taken
                raise
            await self._forget_consumers(key)
            if not pending:
                return []
            attempts = {entry_id: int(count) + 1 for entry_id, _, _, count in pending}
            # XCLAIM checks the idle time again: of two consumers reclaiming at once, one gets each.
            claimed = await self._mux.execute("XCLAIM", key, _INBOX_GROUP, consumer, idle_ms, *attempts)
        return [_delivery(entry[0], entry[1], attempts[entry[0]]) for entry in claimed if entry]

    async def _forget_consumers(self, key: str) -> None:
        """Now and then, drop the group's consumers that hold nothing and have not asked for
        anything for consumer_gone_s (gateway processes long gone: each had a name of its own)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._forget_consumers_at.get(key, 0.0):
            return
        self._forget_consumers_at[key] = loop.time() + 60.0
        consumers = [_pairs(c) for c in await self._mux.execute("XINFO", "CONSUMERS", key, _INBOX_GROUP)]
        gone_ms = self._consumer_gone_s * 1000
        gone = [c["name"] for c in consumers if int(c["pending"]) == 0 and int(c["idle"]) > gone_ms]
        if gone:
            await self._mux.batch([["XGROUP", "DELCONSUMER", key, _INBOX_GROUP, name] for name in gone])
