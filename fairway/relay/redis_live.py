"""Live events for the Redis token log: one sharded Pub/Sub connection per process.

The append script logs each event in its reply's stream and, in the same atomic step, publishes
it (SPUBLISH) on the reply's channel. A subscriber subscribes first and reads the log after
Redis confirmed the subscription, so every event is in what it read or in what it hears, and the
replay->live seam is exact (duplicates are dropped by n; a gap, which only a lost connection
could cause, is filled from the log).

Pub/Sub costs Redis O(1) per event and this process one parsed message per event, however many
replies it follows; a shared blocking XREAD has to name every followed stream on every call,
which at thousands of streams costs both sides more than the events themselves. Channels carry
the reply's hash tag, so on Redis Cluster a reply's channel lives in its stream's slot; there
this would be one connection per node.

The connection's bytes go to a Dispatcher (redis_client.dispatch): while a subscriber's iterator waits
for events and it has a direct sink (the SSE relay's writer, say), its channel is tapped into the
sink and the dispatcher hands it the reply's token events itself (in C, and without a Python
object per event when the sink speaks the C-level protocol), and hands this module only the rest:
the first and last events, subscription confirmations, events of replies with several listeners
here, and anything out of order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.redis_client import RawConnection, RedisClient
from fairway.redis_client.dispatch import (
    HEAD_END,
    TEXT,
    dispatcher_class,
    sequenced_text,
    tap_class,
    tap_table,
)
from fairway.relay.errors import RelayUnavailable, ReplyNotFound
from fairway.relay.events import Event, TokenEvent, event_from_fields
from fairway.relay.token_log import TokenSink

UNSUBSCRIBE_WAIT_S = 0.05  # the longest an unsubscription waits to share a write


def live_payload(event: Event) -> str:
    """What the append script publishes after "<n> " (n, which the script may only assign then,
    is not in it). A token, the event sent thousands of times a second, as "t<ids>\\x1f<text>",
    which takes no JSON to read; any other event (a token with its logprobs too) as "f" + its
    fields in JSON."""
    if isinstance(event, TokenEvent) and not event.logprobs:
        return sequenced_text(",".join(map(str, event.token_ids)), event.text)  # its head: the ids
    fields = event.to_fields()
    del fields["n"]
    return "f" + orjson.dumps(fields).decode()


def event_from_live(message: str) -> Event:
    n, _, payload = message.partition(" ")
    if payload[0] == TEXT:
        ids, _, text = payload[1:].partition(HEAD_END)
        return _token(int(n), text, ids)
    fields = orjson.loads(payload[1:])
    fields["n"] = n
    return event_from_fields(fields)


def _token(n: int, text: str, ids: str) -> TokenEvent:
    return TokenEvent(n, text, [int(i) for i in ids.split(",")] if ids else [])


def reply_id_of(key: str) -> str:
    return key[key.index("{") + 1 : key.rindex("}")]


@dataclass(eq=False)
class LiveSubscriber:
    """One subscription of this process: its reply's live events, in publish order."""

    channel: str
    idle_s: float | None  # next_batch() returns [] after this long without events
    quiet_since: float  # loop time of its last batch (or of joining)
    taps: MutableMapping[str, Any]  # the connection's dispatcher's: channel -> the Tap whose sink it hands events to
    entry: _Channel
    inbox: list[Event] = field(default_factory=list)
    error: Exception | None = None
    waiter: asyncio.Future[None] | None = None
    cursor: int = 0  # n of the last event handed out, by its iterator or to direct
    direct: TokenSink | None = None  # takes the next token event while the iterator waits (see TokenLog)
    tap: Any = None  # direct's Tap, made when it is first tapped in
    tapped: bool = False  # tap is in taps: the dispatcher handed direct what it could; cursor is tap's
    events: LiveEvents | None = None  # the connection's fan-out it came from

    def deliver_token(self, n: int, text: str, ids: str, now: float) -> None:
        """A token event as published (ids still the published string)."""
        if self.tapped:  # the dispatcher could not hand it over: the iterator takes it from here
            self.deliver(_token(n, text, ids))
            return
        # Without a tap (several listeners here): direct may still take it now, without a task
        # wake (and without an event object), if the consumer waits.
        if (self.direct is not None and self.waiter is not None and not self.waiter.done()
                and n == self.cursor + 1 and self.direct(n, text)):
            self.cursor = n
            self.quiet_since = now
            return
        self.deliver(_token(n, text, ids))

    def deliver(self, event: Event) -> None:
        self.inbox.append(event)
        self.wake()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def idle(self, now: float) -> bool:
        quiet_since = max(self.quiet_since, self.tap.last) if self.tapped else self.quiet_since
        return self.idle_s is not None and now - quiet_since >= self.idle_s

    def _tap_in(self) -> None:
        """While this waits, the dispatcher hands its token events to direct, if it has one and is
        the channel's only subscriber here."""
        if self.direct is not None and len(self.entry.subscribers) == 1:
            if self.tap is None or self.tap.sink is not self.direct:
                self.tap = tap_class()(self.direct)
            self.tap.cursor = self.cursor
            self.taps[self.channel] = self.tap
            self.tapped = True

    def _tap_out(self) -> None:
        if not self.tapped:
            return
        if self.taps.get(self.channel) is self.tap:
            del self.taps[self.channel]
        self.tapped = False
        self.cursor = self.tap.cursor
        self.quiet_since = max(self.quiet_since, self.tap.last)

    async def next_batch(self) -> list[Event]:
        """Everything heard since the last call, waiting for at least one event; [] once idle_s
        passed without any (LiveEvents' sweep wakes it for that)."""
        loop = asyncio.get_running_loop()
        while not self.inbox:
            if self.error is not None:
                raise self.error
            if self.idle(loop.time()):
                self.quiet_since = loop.time()
                return []
            self.waiter = loop.create_future()
            self._tap_in()
            try:
                await self.waiter
            finally:
                self.waiter = None
                self._tap_out()
        batch, self.inbox = self.inbox, []
        self.quiet_since = loop.time()
        return batch


@dataclass(eq=False)
class _Channel:
    key: str  # the reply's stream, checked for expiry while the channel is quiet
    ready: asyncio.Future[None]  # Redis confirmed the subscription
    subscribers: set[LiveSubscriber] = field(default_factory=set)
    heard: bool = False  # a message came since the last sweep


Exists = Callable[[list[str]], Awaitable[list[bool]]]
Connect = Callable[[Callable[[bytes], None]], Awaitable[RawConnection]]


class LiveEvents:
    """Fans a process's one Pub/Sub connection out to its subscribers.

    Subscribing and unsubscribing are batched: the commands of one loop iteration go out in one
    write, and an unsubscription waits for the next one (UNSUBSCRIBE_WAIT_S at most). Every
    sweep_s a sweep wakes subscribers idle for their idle_s (keepalives) and, for channels quiet
    since the last sweep, checks that the log still exists: subscribers of an expired log get
    ReplyNotFound. A lost connection fails every subscriber with RelayUnavailable
    (they would have missed events); the next subscription connects afresh.
    """

    def __init__(self, connect: Connect, sweep_s: float, exists: Exists) -> None:
        self._connect = connect
        self._sweep_s = sweep_s
        self._exists = exists
        self._channels: dict[str, _Channel] = {}
        self._taps: MutableMapping[str, Any] = tap_table()  # channel -> Tap, fed by the dispatcher (see LiveSubscriber)
        self._confirming: dict[str, deque[asyncio.Future[None]]] = {}  # per channel, in sending order
        self._outbox: list[tuple[str, str]] = []
        self._flushing = False  # a flush of the outbox is scheduled for this loop iteration
        self._flush_later: asyncio.TimerHandle | None = None  # one for pending unsubscriptions only
        self._conn: RawConnection | None = None
        self._dispatcher: Any = None  # the current connection's
        self._connecting = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []  # the sweep of the current connection

    async def add(self, key: str, channel: str, idle_s: float | None) -> LiveSubscriber:
        """A subscriber of channel (the live side of stream key), once Redis confirmed it."""
        await self._connection()
        loop = asyncio.get_running_loop()
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel(key, loop.create_future())
            self._confirming.setdefault(channel, deque()).append(entry.ready)
            self._send("SSUBSCRIBE", channel)
        else:
            self._taps.pop(channel, None)  # a second listener: the Python path serves both
        sub = LiveSubscriber(channel, idle_s, loop.time(), self._taps, entry, events=self)
        entry.subscribers.add(sub)
        try:
            await asyncio.shield(entry.ready)  # shared: one subscriber giving up must not cancel it
        except BaseException:
            self.remove(sub)
            raise
        return sub

    def remove(self, sub: LiveSubscriber) -> None:
        entry = self._channels.get(sub.channel)
        if entry is None or sub not in entry.subscribers:
            return
        entry.subscribers.discard(sub)
        if not entry.subscribers:
            del self._channels[sub.channel]
            self._send("SUNSUBSCRIBE", sub.channel)

    async def close(self) -> None:
        conn = self._fail_all(RelayUnavailable("the token log was closed"))
        if conn is not None:
            conn.close()

    # -- the connection ----------------------------------------------------------------------

    async def _connection(self) -> RawConnection:
        if self._conn is not None:
            return self._conn
        async with self._connecting:
            if self._conn is None:
                # Its own connection (a subscribed one takes no other commands), in RESP2, whose
                # bytes go to the dispatcher whole: one socket read brings hundreds of messages
                # under load.
                try:
                    conn = await self._connect(self._on_data)
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    raise RelayUnavailable(f"Redis unreachable: {exc}") from exc
                self._conn = conn
                self._dispatcher = dispatcher_class()(self._taps, ResponseError)
                conn.closed.add_done_callback(lambda _: self._lost(conn))
                self._tasks = [asyncio.create_task(self._sweep(), name="redis-token-log-sweep")]
        assert self._conn is not None
        return self._conn

    def _lost(self, conn: RawConnection) -> None:
        if self._conn is conn:
            self._failed(RelayUnavailable("Redis unreachable: the live events connection was lost"))

    def _send(self, command: str, channel: str) -> None:
        """Queue a (un)subscription. A subscription goes out at the end of this loop iteration,
        with whatever else is queued, in one write. An unsubscription waits for the next
        subscription's write, or UNSUBSCRIBE_WAIT_S at most: a reply's channel is silent once it
        ended, and each write costs a system call and Redis a read."""
        if self._conn is None:
            return  # failed meanwhile: nothing is subscribed any more
        self._outbox.append((command, channel))
        if self._flushing:
            return
        loop = asyncio.get_running_loop()
        if command != "SUNSUBSCRIBE":
            self._flushing = True
            loop.call_soon(self._flush)
        elif self._flush_later is None:
            self._flush_later = loop.call_later(UNSUBSCRIBE_WAIT_S, self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None
        commands, self._outbox = self._outbox, []
        if not commands or self._conn is None:
            return
        try:
            self._conn.send([list(command) for command in commands])
        except (RedisConnectionError, OSError) as exc:
            self._failed(RelayUnavailable(f"Redis unreachable: {exc}"))

    def _on_data(self, data: bytes) -> None:
        now = asyncio.get_running_loop().time()  # (one clock read per socket read: it only times keepalives)
        try:
            for message in self._dispatcher.feed(data, now):
                if isinstance(message, Exception):
                    raise message
                self._on_message(message, now)
        except Exception as exc:  # e.g. a Redis without sharded Pub/Sub (< 7.0); never leave subscribers waiting
            self._failed(RelayUnavailable(f"live events failed: {exc!r}"))

    def _on_message(self, message: list[str], now: float) -> None:
        kind, channel = message[0], message[1]
        if kind == "smessage":
            entry = self._channels.get(channel)
            if entry is not None:
                entry.heard = True
                n, _, payload = message[2].partition(" ")
                if payload[0] == TEXT:
                    ids, _, text = payload[1:].partition(HEAD_END)
                    for sub in entry.subscribers:
                        sub.deliver_token(int(n), text, ids, now)
                else:
                    event = event_from_live(message[2])
                    for sub in entry.subscribers:
                        sub.deliver(event)
        elif kind == "ssubscribe":
            waiting = self._confirming.get(channel)
            if waiting:
                ready = waiting.popleft()
                if not waiting:
                    del self._confirming[channel]
                if not ready.done():
                    ready.set_result(None)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._sweep_s)
            now = loop.time()
            quiet: list[tuple[str, _Channel]] = []
            for name, entry in self._channels.items():
                for sub in entry.subscribers:
                    if sub.idle(now):
                        sub.wake()
                if not entry.heard:
                    quiet.append((name, entry))
                entry.heard = False
            if quiet:
                with suppress(RelayUnavailable):  # the reader reports outages
                    found = await self._exists([entry.key for _, entry in quiet])
                    for (name, entry), exists in zip(quiet, found, strict=True):
                        if not exists and self._channels.get(name) is entry:
                            self._drop(name, entry, ReplyNotFound(reply_id_of(entry.key)))

    def _drop(self, name: str, entry: _Channel, error: Exception) -> None:
        del self._channels[name]
        for sub in entry.subscribers:
            sub.fail(error)
        self._send("SUNSUBSCRIBE", name)

    def _failed(self, error: Exception) -> None:
        conn = self._fail_all(error)
        if conn is not None:
            conn.close()

    def _fail_all(self, error: Exception) -> RawConnection | None:
        """Fail every subscriber and forget the connection, which the caller closes."""
        conn, self._conn = self._conn, None
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        for entry in self._channels.values():
            if not entry.ready.done():
                entry.ready.set_exception(error)
                entry.ready.exception()  # retrieved: nobody else may be waiting for it
            for sub in entry.subscribers:
                sub.fail(error)
        self._channels.clear()
        self._taps.clear()
        self._confirming.clear()
        self._outbox.clear()
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None
        return conn


class LiveRouter:
    """LiveEvents per Redis node: on a single server one connection for every channel; on a
    Redis Cluster one per master, each channel subscribed where its slot lives."""

    def __init__(self, client: RedisClient, sweep_s: float, exists: Exists) -> None:
        self._client = client
        self._sweep_s = sweep_s
        self._exists = exists
        self._nodes: dict[str, LiveEvents] = {}

    async def add(self, key: str, channel: str, idle_s: float | None) -> LiveSubscriber:
        try:
            node = await self._client.node_of(channel)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RelayUnavailable(f"Redis unreachable: {exc}") from exc
        events = self._nodes.get(node)
        if events is None:
            async def connect(on_data: Callable[[bytes], None]) -> RawConnection:
                return await self._client.connect_raw(on_data, channel)

            events = self._nodes[node] = LiveEvents(connect, self._sweep_s, self._exists)
        return await events.add(key, channel, idle_s)

    def remove(self, sub: LiveSubscriber) -> None:
        if sub.events is not None:
            sub.events.remove(sub)

    async def close(self) -> None:
        for events in self._nodes.values():
            await events.close()
        self._nodes.clear()
