"""InProcessTokenLog: the embedded token log (one process, `make serve`), plain asyncio.

Logs are lists in a dict; each log has an asyncio.Event that is set and replaced on every append,
so waiting subscribers wake exactly when there is something new. Expiry is by timestamp, checked
on access and swept lazily, so no background task is needed. A subscriber keeps the log object it
first read: another one under the reply's id later (the reply run again) ends it with LogReplaced.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fairway.relay.arrivals import new_signal
from fairway.relay.errors import EventOutOfOrder, LogReplaced, RelayError, ReplyFinished, ReplyNotFound
from fairway.relay.events import Event, FinalEvent, TokenEvent, ToolEvent, with_n
from fairway.relay.token_log import (
    DEFAULT_TTL_S,
    TokenLog,
    TokenSink,
    check_after,
    check_producer_run,
    check_run,
    check_token_events,
    producer_runs,
)


@dataclass
class _Log:
    touched: float  # monotonic time of the last event (or create): retention counts from here
    listened_at: float  # wall time the last listener left (or create)
    events: list[Event] = field(default_factory=list)  # events[i].n == i + 1
    changed: asyncio.Event = field(default_factory=new_signal)
    listeners: int = 0
    stop: bool = False
    run: int | None = None  # the reply's run it holds (create(), or its first append's); None: not said

    @property
    def last_n(self) -> int:
        return self.events[-1].n if self.events else 0

    @property
    def finished(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], FinalEvent)

    def notify(self) -> None:
        # Wake everyone waiting on the old signal; later waiters get a fresh one.
        self.changed.set()
        self.changed = asyncio.Event()


class InProcessTokenLog(TokenLog):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, *, poll_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self._poll_s = poll_s  # how often an idle subscriber re-checks that its log has not expired
        self._logs: dict[str, _Log] = {}
        self._last_sweep = time.monotonic()
        self._stop_watchers: set[asyncio.Queue[str]] = set()

    # -- storage helpers ---------------------------------------------------------------------

    def _get(self, reply_id: str) -> _Log | None:
        self._sweep()
        log = self._logs.get(reply_id)
        if log is not None and time.monotonic() - log.touched > self.ttl_s:
            del self._logs[reply_id]
            return None
        return log

    def _require(self, reply_id: str) -> _Log:
        log = self._get(reply_id)
        if log is None:
            raise ReplyNotFound(reply_id)
        return log

    def _sweep(self) -> None:
        # Lazy: at most once per min(ttl, 1 s), drop every expired log so memory stays bounded.
        now = time.monotonic()
        if now - self._last_sweep < min(self.ttl_s, 1.0):
            return
        self._last_sweep = now
        for reply_id in [r for r, log in self._logs.items() if now - log.touched > self.ttl_s]:
            del self._logs[reply_id]

    def _open(self, run: int | None = None) -> _Log:
        return _Log(touched=time.monotonic(), listened_at=time.time(), run=run)

    # -- the log -----------------------------------------------------------------------------

    async def create(self, reply_id: str, run: int = 0) -> bool:
        if self._get(reply_id) is not None:
            return False
        self._logs[reply_id] = self._open(run)
        return True

    async def append_many(self, items: Sequence[tuple[str, TokenEvent | ToolEvent]],
                          runs: Sequence[int | None] | None = None) -> list[int | Exception]:
        check_token_events(items)
        results: list[int | Exception] = []
        for (reply_id, event), run in zip(items, producer_runs(items, runs), strict=True):
            try:
                results.append(self._add(reply_id, event, run))
            except RelayError as exc:
                results.append(exc)
        return results

    async def finish(self, reply_id: str, final: FinalEvent, run: int | None = None) -> int:
        if not isinstance(final, FinalEvent):
            raise TypeError("finish() takes a FinalEvent")
        return self._add(reply_id, final, run)

    def _add(self, reply_id: str, event: Event, run: int | None) -> int:
        log = self._get(reply_id)
        if log is None:
            if event.n > 1:  # not a first event: refused, as by Redis, without leaving a log
                raise EventOutOfOrder(reply_id, event.n, 0)
            log = self._logs[reply_id] = self._open(run)
        check_producer_run(reply_id, run, log.run)  # (before the order: across runs it means nothing)
        if log.finished:
            raise ReplyFinished(reply_id, log.last_n)
        n = event.n or log.last_n + 1
        if n != log.last_n + 1:
            raise EventOutOfOrder(reply_id, n, log.last_n)
        log.events.append(with_n(event, n))
        log.touched = time.monotonic()
        log.notify()
        return n

    async def read(self, reply_id: str, after: int = 0, run: int | None = None) -> list[Event]:
        log = self._require(reply_id)
        check_run(reply_id, run, log.run)
        check_after(reply_id, after, log.last_n, log.finished)
        return log.events[after:]

    async def subscribe_batches(
        self, reply_id: str, after: int = 0, idle_s: float | None = None, direct: TokenSink | None = None,
        run: int | None = None,
    ) -> AsyncIterator[list[Event]]:
        # direct is not used: one process serves a few streams, for which a task wake is cheap.
        log = self._require(reply_id)
        check_run(reply_id, run, log.run)
        check_after(reply_id, after, log.last_n, log.finished)
        counted = log  # the object we counted on, even if the id's log expires and is recreated
        counted.listeners += 1
        loop = asyncio.get_running_loop()
        try:
            cursor, quiet_since = after, loop.time()
            while True:
                batch = log.events[cursor:]
                if batch:
                    yield batch
                    cursor, quiet_since = batch[-1].n, loop.time()
                    if isinstance(batch[-1], FinalEvent):
                        return
                    continue
                if log.finished:
                    return  # the cursor is at the terminal event already: nothing will follow
                await self._wait(log.changed)
                if self._require(reply_id) is not log:  # expired while we waited -> ReplyNotFound
                    raise LogReplaced(reply_id, run, self._logs[reply_id].run)  # lost, and made again
                if idle_s is not None and loop.time() - quiet_since >= idle_s and not log.events[cursor:]:
                    yield []
                    quiet_since = loop.time()
        finally:
            counted.listeners -= 1
            counted.listened_at = time.time()

    async def _wait(self, signal: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(signal.wait(), self._poll_s)
        except TimeoutError:
            pass

    async def exists_many(self, reply_ids: Sequence[str]) -> list[bool]:
        return [self._get(reply_id) is not None for reply_id in reply_ids]

    async def last_event_id(self, reply_id: str) -> int:
        return self._require(reply_id).last_n

    # -- listeners ---------------------------------------------------------------------------

    async def listener_count(self, reply_id: str) -> int:
        log = self._get(reply_id)
        return log.listeners if log else 0

    async def listener_idle_many(self, reply_ids: Sequence[str]) -> list[float | None]:
        now = time.time()
        logs = [self._get(reply_id) for reply_id in reply_ids]
        return [None if log is None else 0.0 if log.listeners else max(0.0, now - log.listened_at) for log in logs]

    # -- control -----------------------------------------------------------------------------

    async def request_stop(self, reply_id: str) -> bool:
        log = self._require(reply_id)
        if log.finished:
            return False
        log.stop = True
        for watcher in self._stop_watchers:
            watcher.put_nowait(reply_id)
        return True

    async def stop_requested(self, reply_id: str) -> bool:
        log = self._get(reply_id)
        return bool(log and log.stop)

    async def watch_stops(self) -> AsyncIterator[str]:
        inbox: asyncio.Queue[str] = asyncio.Queue()
        self._stop_watchers.add(inbox)
        try:
            while True:
                yield await inbox.get()
        finally:
            self._stop_watchers.discard(inbox)
