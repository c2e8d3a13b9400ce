"""RedisTokenLog: the at-scale token log, shared by every gateway and replica process.

Layout (the {reply id} hash tag keeps a reply's keys in one Redis Cluster slot, so the Lua
scripts below stay single-slot):

  {prefix}reply:{<id>}            Stream: header 0-1 from create(), event n at stream id n-0
                                  (once the final event is in, its last id set to the largest)
  {prefix}reply:{<id>}:live       shard channel: each event as it is appended (SPUBLISH)
  {prefix}reply:{<id>}:listeners  ZSET listener token -> heartbeat deadline (server time)
  {prefix}reply:{<id>}:listened   when a listener was last seen (server time)
  {prefix}reply:{<id>}:stop       stop flag
  {prefix}reply:{<id>}:run        the reply's run the log holds, when not its first (create(run=k),
                                  or the first append's producer's run)
  {prefix}control                 Stream of stop requests, tailed by replicas (capped)

Explicit stream ids make n the id: a replay "after n" is an exact range, and Redis itself rejects
a second event n, so a duplicate can never be stored. Live events reach all of a process's
subscribers through one sharded Pub/Sub connection (redis_live.LiveEvents), the append script
publishing each event in the same atomic step that logs it. Per-process batching keeps the
round trips and calls per event small: append_many() sends one engine step's events for all of a
replica's replies in one round trip, APPENDS_PER_CALL events to a call of the append script (on a
cluster, those of one slot together), and the heartbeats of all of a gateway's listeners go in one
pipeline per tick (_Heartbeats). Every key carries a TTL refreshed by the writes that matter, so retention
needs no sweeper.

Which run of a reply a log holds (a reply whose log was lost runs again under the same id) is its
run key, read in the same atomic step as what it qualifies: a reader's snapshot reads it in the
MULTI that reads the events, and the append script publishes a run k's events as k * RUN_SPAN + n
(the ids clients see), so a subscriber of one run tells another run's live events from its own
without a round trip. A first run's log has no run key: its events go out as before, as n. The
same script refuses a producer's event of another run than the run key says (absent: run 0) with
FAIRWAY_REPLACED (RunReplaced), before it looks at n: a replica still running a lost log's run
never writes into the next run's log, even where its next n happens to fit it.

A rolling upgrade mixes versions on one Redis: (1) a replica of the previous version appending to
a run-k log runs its own script, which neither reads nor refreshes the run key and publishes n; a
subscriber of run k takes such an event as another log's and reads the log instead (its run key
still says k, so the read's events are its own): the stream goes on, one read per batch. (2) A
gateway of the previous version restarting a reply writes no run key; every reader takes that log
for its run, as before (check_run). (3) A gateway of the previous version subscribed to a run-k log
hears k * RUN_SPAN + n from new replicas: a gap, to its code, which it fills by reading the log
after its cursor, as for a lost message; its stream goes on, one read per batch. Until every
process runs this version, a subscriber can still mistake a new log's events for its own where
the new log was made, or is appended to, by the previous version. (4) A replica of the previous
version names no run in its appends (its own script) and a gateway of the previous version puts
none in its jobs (GenerationJob.run None): neither is checked, as before.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from fairway.redis_client import (
    Command,
    RedisClient,
    Script,
    args_format,
    field_pairs,
    pack,
    pack_args,
    pack_call,
    script_call,
)
from fairway.relay.errors import (
    EventOutOfOrder,
    LogReplaced,
    RelayError,
    RelayUnavailable,
    ReplyFinished,
    ReplyNotFound,
    RunReplaced,
)
from fairway.relay.events import Event, FinalEvent, TokenEvent, ToolEvent, event_from_fields, with_n
from fairway.relay.redis_guard import guard
from fairway.relay.redis_live import LiveRouter, live_payload
from fairway.relay.token_log import (
    DEFAULT_TTL_S,
    LISTENER_STALE_S,
    RUN_SPAN,
    TokenLog,
    TokenSink,
    check_after,
    check_run,
    check_token_events,
    producer_runs,
    raise_if_error,
)
from fairway.uncancelled import finish_anyway

# A subscriber whose live connection broke (a Redis restart) tries to come back for this long.
OUTAGE_S = 30.0

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# KEYS: stream, listened, run. ARGV: ttl_ms, run. Header entry 0-1 lets an empty log exist (streams
# can't be empty otherwise) and sorts before event 1-0. A first run's log has no run key.
_CREATE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '0-1', 'k', 'open')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], string.format('%.6f', now), 'PX', ARGV[1])
if ARGV[2] == '0' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1]) end
return 1
"""
)

# KEYS: per event, its stream, listened, live channel and run. ARGV: ttl_ms, then per event its n
# (0 = next), its producer's run ('' = not said: not checked), live payload, kind, how many
# field/value items follow, and those items. Returns per event its n or its error. Atomic
# check-append-publish for each: the run and numbering rules hold even with two producers racing
# (failover; a replica still running a lost log's run), and an event is published exactly when it
# is logged, as run * RUN_SPAN + n for a log of a run after the first (its run key; a first run's
# has none, which costs its events one GET of a missing key). One call takes many events (a
# replica's step), so Redis pays its per-call cost once for them, not per token.
#
# A log is its header (0-1) and events 1..last, never trimmed, so its length says last; its final
# event sets the stream's last id past any event's, so Redis itself refuses any XADD after it.
# Only an append that does not fit reads the log's top entry (what XLEN saves: most of a token's
# script time went to converting that entry into Lua).
_APPEND = """
local ttl = ARGV[1]
local function refused(log, n, added)
  local top = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
  local last = tonumber(string.match(top[1], '^(%d+)-'))
  if top[2][2] == 'f' then return redis.error_reply('FAIRWAY_FINISHED ' .. last) end
  return added or redis.error_reply('FAIRWAY_ORDER ' .. last)
end
local function append(log, listened, live, runkey, a, last_arg)
  local size = redis.call('XLEN', log)
  local n = tonumber(ARGV[a])
  local mine, run = ARGV[a + 1], false
  if size == 0 then  -- a log create() never made (or one expired): its header first, of the producer's run
    if n > 1 then return redis.error_reply('FAIRWAY_ORDER 0') end
    """ + _NOW + """
    redis.call('SET', listened, string.format('%.6f', now), 'PX', ttl, 'NX')
    redis.call('XADD', log, '0-1', 'k', 'open')
    redis.call('PEXPIRE', log, ttl)
    if mine == '' or mine == '0' then
      redis.call('DEL', runkey)
    else
      redis.call('SET', runkey, mine, 'PX', ttl)
      run = mine
    end
    size = 1
  else
    run = redis.call('GET', runkey)
    -- another run's producer (its log was lost; this is the next run's): refused, whatever its n
    if mine ~= '' and mine ~= (run or '0') then return redis.error_reply('FAIRWAY_REPLACED ' .. (run or '0')) end
  end
  if n == 0 then n = size end
  if n ~= size then return refused(log, n, nil) end
  -- pcall: a write Redis refuses (after the final event; out of memory) fails this event alone
  local added = redis.pcall('XADD', log, n .. '-0', 'k', ARGV[a + 3], 'n', n, unpack(ARGV, a + 5, last_arg))
  if type(added) == 'table' and added.err then return refused(log, n, added) end
  if ARGV[a + 3] == 'f' then redis.call('XSETID', log, '18446744073709551615-18446744073709551615') end
  redis.call('PEXPIRE', log, ttl)
  local id = n
  if run then
    redis.call('PEXPIRE', runkey, ttl)
    id = string.format('%d', tonumber(run) * """ + str(RUN_SPAN) + """ + n)
  end
  redis.call('SPUBLISH', live, id .. ' ' .. ARGV[a + 2])
  return n
end
local results, a = {}, 2
for i = 1, #KEYS, 4 do
  local last_arg = a + 4 + tonumber(ARGV[a + 4])
  results[#results + 1] = append(KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3], a, last_arg)
  a = last_arg + 1
end
return results
"""
# Events per append call: Redis runs a call whole, the other clients' commands waiting meanwhile.
APPENDS_PER_CALL = 64

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


def _script_error(exc: ResponseError, reply_id: str, n: int, run: int | None) -> Exception:
    code, _, last = str(exc).partition(" ")
    if code == "FAIRWAY_REPLACED" and run is not None:
        return RunReplaced(reply_id, run, int(last))
    if code == "FAIRWAY_FINISHED":
        return ReplyFinished(reply_id, int(last))
    if code == "FAIRWAY_ORDER":
        return EventOutOfOrder(reply_id, n, int(last))
    return exc


def _n_of(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _events(entries: list[tuple[str, dict[str, str]]]) -> list[Event]:
    return [event_from_fields(fields) for _, fields in entries if fields.get("k") != "open"]


def _of_run(batch: list[Event], held: int | None) -> list[Event] | None:
    """Live events of the log that holds run `held`, numbered as in that log (the append script
    publishes run * RUN_SPAN + n); None when any was published otherwise: not its own, or not
    told apart from another log's."""
    if not held:
        return batch if all(event.n < RUN_SPAN for event in batch) else None
    own: list[Event] = []
    for event in batch:
        run, n = divmod(event.n, RUN_SPAN)
        if run != held:
            return None
        own.append(with_n(event, n))
    return own


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
        await finish_anyway(self._leave(reply_id, token))

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


class RedisTokenLog(TokenLog):
    def __init__(
        self,
        client: RedisClient,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "fairway:",
        heartbeat_s: float = 2.0,
        listener_stale_s: float = LISTENER_STALE_S,
        control_maxlen: int = 100_000,
    ) -> None:
        self.ttl_s = ttl_s
        self._client = client
        self._prefix = prefix
        self._stale_s = listener_stale_s
        self._control_maxlen = control_maxlen
        # How often live subscribers are checked for idleness (keepalives) and expired logs: one
        # blocking wait's length.
        self._live = LiveRouter(client, client.block_s, self._exist)
        self._heartbeats = _Heartbeats(self, heartbeat_s)
        self._create = Script(_CREATE)
        self._append = Script(_APPEND)
        # A token's part of an append call: its keys; its n, run, live payload, kind t and its fields.
        self._token_keys = args_format([None] * 4)
        self._token_args = args_format([None, None, None, b"t", b"4", b"text", None, b"ids", None])
        self._heartbeat = Script(_HEARTBEAT)
        self._listeners = Script(_LISTENERS)
        self._stop = Script(_STOP)

    # -- keys --------------------------------------------------------------------------------

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def _key(self, reply_id: str, part: str = "") -> str:
        return f"{self._prefix}reply:{{{reply_id}}}{':' + part if part else ''}"

    @property
    def _control_key(self) -> str:
        return f"{self._prefix}control"

    async def close(self) -> None:
        """Stops this log's heartbeats and live events; the client is its owner's to close."""
        await self._heartbeats.close()
        await self._live.close()

    async def _scripts(self, script: Script, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """run_scripts (one round trip for all calls), transport errors as RelayUnavailable."""
        with guard():
            return await self._client.run_scripts(script, calls)

    async def _exist(self, keys: list[str]) -> list[bool]:
        with guard():
            return [bool(found) for found in await self._client.batch([["EXISTS", key] for key in keys])]

    # -- the log -----------------------------------------------------------------------------

    def _create_keys(self, reply_id: str) -> list[str]:
        return [self._key(reply_id), self._key(reply_id, "listened"), self._key(reply_id, "run")]

    def create_command(self, reply_id: str, run: int = 0) -> Command:
        """create() as one command, for a caller that pipelines it with others (a new reply's
        job): EVAL, not EVALSHA, since a script Redis lost (NOSCRIPT) would fail the create while
        the others still ran."""
        keys = self._create_keys(reply_id)
        return ["EVAL", self._create.script, len(keys), *keys, self._ttl_ms, run]

    async def create(self, reply_id: str, run: int = 0) -> bool:
        with guard():
            return bool(await self._client.execute(*self.create_command(reply_id, run)))

    async def append_many(self, items: Sequence[tuple[str, TokenEvent | ToolEvent]],
                          runs: Sequence[int | None] | None = None) -> list[int | Exception]:
        check_token_events(items)
        return await self._add(items, producer_runs(items, runs))

    async def finish(self, reply_id: str, final: FinalEvent, run: int | None = None) -> int:
        if not isinstance(final, FinalEvent):
            raise TypeError("finish() takes a FinalEvent")
        return raise_if_error((await self._add([(reply_id, final)], [run]))[0])

    async def _add(self, items: Sequence[tuple[str, Event]], runs: Sequence[int | None]) -> list[int | Exception]:
        """The events appended, a step's worth in few calls of the append script (script_groups:
        APPENDS_PER_CALL a call, those of one slot together on a cluster); runs: their producers'."""
        parts = [self._token_part(reply_id, event, run) if isinstance(event, TokenEvent) and not event.logprobs
                 else self._event_part(reply_id, event, run) for (reply_id, event), run in zip(items, runs, strict=True)]
        ttl = pack_args([self._ttl_ms])
        with guard():
            groups = await self._client.script_groups([part[0] for part in parts], APPENDS_PER_CALL)
            calls = [script_call(self._append, [parts[i][1] for i in group], [ttl, *(parts[i][2] for i in group)],
                                 4 * len(group), 1 + sum(parts[i][3] for i in group)) for group in groups]
            replies = await self._client.run_packed_scripts(self._append, calls)
        results: list[int | Exception] = [0] * len(items)
        for group, reply in zip(groups, replies, strict=True):
            # A call that failed whole (no script ran) fails each of its events.
            for i, result in zip(group, reply if isinstance(reply, list) else [reply] * len(group), strict=True):
                reply_id, event = items[i]
                results[i] = (_script_error(result, reply_id, event.n, runs[i]) if isinstance(result, ResponseError)
                              else int(result))
        return results

    def _event_part(self, reply_id: str, event: Event, run: int | None) -> tuple[str, bytes, bytes, int]:
        """An event's part of an append call: its stream's key, the packed keys, the packed
        arguments and how many they are."""
        fields = event.to_fields()
        kind = fields.pop("k")
        fields.pop("n")  # the script writes the n it assigned or validated
        flat = [item for pair in fields.items() for item in pair]
        key = self._key(reply_id)
        args = [event.n, b"" if run is None else run, live_payload(event), kind, len(flat), *flat]
        return key, pack_args([key, key + ":listened", key + ":live", key + ":run"]), pack_args(args), len(args)

    def _token_part(self, reply_id: str, event: TokenEvent, run: int | None) -> tuple[str, bytes, bytes, int]:
        """_event_part for a token, filled into formats (the same bytes): a replica packs one a
        token, and building the fields dict and packing each argument by type was most of its cost."""
        ids = ",".join(map(str, event.token_ids)).encode()
        text = event.text.encode()
        key = self._key(reply_id)
        log, listened, live, runkey = (key.encode(), (key + ":listened").encode(), (key + ":live").encode(),
                                       (key + ":run").encode())
        n, mine, payload = b"%d" % event.n, b"" if run is None else b"%d" % run, b"t%b\x1f%b" % (ids, text)
        return (key, self._token_keys % (len(log), log, len(listened), listened, len(live), live, len(runkey), runkey),
                self._token_args % (len(n), n, len(mine), mine, len(payload), payload, len(text), text, len(ids), ids),
                9)

    async def _snapshot(self, reply_id: str, after: int, join: str | None = None
                        ) -> tuple[list[Event], bool, int | None]:
        """Validated events after `after`, whether the log has ended and the run it holds (None:
        not said), read atomically (MULTI/EXEC) so the three agree. With join (a listener's
        token), the listener is counted in the same round trip, right after the read."""
        key = self._key(reply_id)
        calls = [pack(["MULTI"]), pack(["XREVRANGE", key, "+", "-", "COUNT", 1]),
                 pack(["XRANGE", key, f"{after + 1}-0", "+"]), pack(["GET", key + ":run"]), pack(["EXEC"])]
        if join is not None:
            calls.append(self._beat_call(reply_id, join))
        with guard():
            results = await self._client.batch_packed(calls)
        if join is not None and isinstance(results[5], NoScriptError):
            await self._beat([(reply_id, join)])  # (Redis lost the script: _beat reloads it)
        elif join is not None:
            raise_if_error(results[5])
        top, entries, run = (raise_if_error(part) for part in raise_if_error(results[4]))
        if not top:
            raise ReplyNotFound(reply_id)
        top_id, top_flat = top[0]
        finished = field_pairs(top_flat).get("k") == "f"
        check_after(reply_id, after, _n_of(top_id), finished)
        events = _events([(entry_id, field_pairs(flat)) for entry_id, flat in entries])
        return events, finished, None if run is None else int(run)

    async def read(self, reply_id: str, after: int = 0, run: int | None = None) -> list[Event]:
        events, _, held = await self._snapshot(reply_id, after)
        check_run(reply_id, run, held)
        return events

    async def _read_run(self, reply_id: str, after: int, held: int | None) -> list[Event]:
        """read() for a subscriber of the log that held run `held` when it first read it: that
        log's events, or LogReplaced when the log under the id says another run (or none) now."""
        events, _, now_held = await self._snapshot(reply_id, after)
        if now_held != held:
            raise LogReplaced(reply_id, held, now_held)
        return events

    async def subscribe_batches(
        self, reply_id: str, after: int = 0, idle_s: float | None = None, direct: TokenSink | None = None,
        run: int | None = None,
    ) -> AsyncIterator[list[Event]]:
        # Subscribed before the log is read: every event is in the replay or heard live (or both).
        sub = await self._live.add(self._key(reply_id), self._key(reply_id, "live"), idle_s)
        try:
            # Counted as a listener before the first event is handed out, in the read's round trip.
            token = secrets.token_hex(16)
            try:
                replay, finished, held = await self._snapshot(reply_id, after, join=token)
                check_run(reply_id, run, held)
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
                            fresh = await self._read_run(reply_id, cursor, held)  # a gap (a lost message): the log has it all
                    if fresh:
                        sub.cursor = fresh[-1].n
                        if isinstance(fresh[-1], FinalEvent):
                            ended = True
                        yield fresh
                        if ended:
                            return
                    try:
                        batch = _of_run(await sub.next_batch(), held)
                        if batch is None:  # another run's events, or an old replica's (module doc): ask the log
                            batch = await self._read_run(reply_id, sub.cursor, held)
                    except RelayUnavailable:
                        # Redis went away (a restart): the live connection is gone. Come back on a
                        # new one, from the log after the cursor; idle batches meanwhile.
                        cursor = sub.cursor
                        self._live.remove(sub)
                        batch = []
                        async for sub, replay in self._resubscribe(reply_id, cursor, idle_s, direct, held):
                            if sub is None:
                                yield []
                            batch = replay
                        continue
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
            if sub is not None:
                self._live.remove(sub)

    async def _resubscribe(self, reply_id: str, cursor: int, idle_s: float | None, direct: TokenSink | None,
                           held: int | None) -> AsyncIterator[tuple[Any, list[Event]]]:
        """(None, []) every idle_s (or second) while Redis stays away, up to OUTAGE_S; then the
        new subscriber and the log's events after cursor. RelayUnavailable after OUTAGE_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OUTAGE_S
        delay = 0.1
        while True:
            try:
                sub = await self._live.add(self._key(reply_id), self._key(reply_id, "live"), idle_s)
            except RelayUnavailable:
                sub = None
            if sub is not None:
                try:
                    replay = await self._read_run(reply_id, cursor, held)
                except RelayUnavailable:
                    self._live.remove(sub)
                else:
                    sub.cursor, sub.direct = cursor, direct
                    yield sub, replay
                    return
            if loop.time() > deadline:
                raise RelayUnavailable(f"Redis unreachable for over {OUTAGE_S:.0f} s")
            yield None, []
            await asyncio.sleep(min(delay, idle_s or 1.0))
            delay = min(delay * 2, 1.0)

    async def _beat(self, listeners: list[tuple[str, str]], leaving: bool = False) -> None:
        """Heartbeats of (reply id, token) listeners, one round trip for all."""
        await self._beat_packed([self._beat_call(reply_id, token, leaving) for reply_id, token in listeners])

    def _beat_call(self, reply_id: str, token: str, leaving: bool = False) -> bytes:
        return pack_call(self._heartbeat, [self._key(reply_id, "listeners"), self._key(reply_id, "listened")],
                           [token, self._ttl_ms, "1" if leaving else "0", self._stale_s])

    async def _beat_packed(self, calls: list[bytes]) -> None:
        with guard():
            await self._client.run_packed_scripts(self._heartbeat, calls)

    async def exists_many(self, reply_ids: Sequence[str]) -> list[bool]:
        return await self._exist([self._key(reply_id) for reply_id in reply_ids]) if reply_ids else []

    async def last_event_id(self, reply_id: str) -> int:
        with guard():
            top = await self._client.execute("XREVRANGE", self._key(reply_id), "+", "-", "COUNT", 1)
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

    async def listener_idle_many(self, reply_ids: Sequence[str]) -> list[float | None]:
        return [None if not exists or listened is None else 0.0 if count else max(0.0, now - listened)
                for count, listened, now, exists in await self._listener_states(reply_ids)]

    # -- control -----------------------------------------------------------------------------

    async def request_stop(self, reply_id: str) -> bool:
        keys = [self._key(reply_id), self._key(reply_id, "stop")]
        with guard():
            outcome = int(raise_if_error((await self._client.run_scripts(self._stop, [(keys, [self._ttl_ms])]))[0]))
            if outcome < 0:
                raise ReplyNotFound(reply_id)
            if outcome == 0:
                return False
            # Flag first, then notify: a watcher that misses the notice still finds the flag. The
            # control stream lives in another cluster slot, hence a separate command.
            await self._client.execute("XADD", self._control_key, "MAXLEN", "~", self._control_maxlen, "*",
                                       "op", "stop", "reply", reply_id)
        return True

    async def stop_requested(self, reply_id: str) -> bool:
        return (await self._exist([self._key(reply_id, "stop")]))[0]

    async def watch_stops(self) -> AsyncIterator[str]:
        key = self._control_key
        with guard():
            top = await self._client.execute("XREVRANGE", key, "+", "-", "COUNT", 1)
        cursor = top[0][0] if top else "0-0"  # an explicit id, not "$": nothing slips in between calls
        while True:
            with guard():
                result = await self._client.blocking(
                    lambda wait, cursor=cursor: ["XREAD", "COUNT", 512, "BLOCK", max(1, int(wait * 1000)), "STREAMS",
                                                 key, cursor],
                    None)
            for entry_id, flat in result[0][1] if result else []:
                cursor = entry_id
                fields = field_pairs(flat)
                if fields.get("op") == "stop":
                    yield fields["reply"]
