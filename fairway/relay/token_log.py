"""TokenLog: each reply's numbered events, kept ttl_s after the last one, readable from any gateway.

The flow it serves (design seed "Wi-Fi drops at token 212, then Stop at 260"):

* the gateway create()s the reply's log, submits the job (job_queue.py), then subscribe()s (its
  SSE writer uses subscribe_batches(): the events that arrived together, and empty batches for
  keepalives);
* the replica append()s token n = 1, 2, 3, ... (append_many(): one step's tokens of all its
  replies at once) and finally finish()es with the terminal event;
* a client that reconnects anywhere with Last-Event-ID 212 gets subscribe(after=212): 213
  onwards from the log at once, then live, with no gap and no repeat;
* Stop at any gateway is request_stop(); the replica owning the reply sees it through
  watch_stops() (or stop_requested()) and finishes with state STOPPED, keeping the text;
* every subscriber counts as a listener while it iterates; when nobody has listened for 30 s the
  replica cancels the reply ("nobody is listening"), checking all its replies at once with
  listener_idle_many();
* a reply whose log was lost runs again in a new log under the same id. Its runs are counted
  (Reply.restarts: 0 for the first, k + 1 for the restart after run k) and each run is made once:
  create(run=k) says which run a log holds (a log made by a producer's append, the producer's
  run; nobody's said: run 0). A reader that names its run (read(run=), subscribe(run=)) is told
  LogReplaced, atomically with what it reads, rather than handed another run's events as its
  run's (which would splice two different texts into one message); a producer that names its run
  (append(run=), finish(run=): its job's GenerationJob.run) is told RunReplaced by a log of any
  other run, atomically with the append, rather than having its next n fit the new run's log.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

from fairway.relay.errors import EventIdOutOfRange, LogReplaced, RunReplaced
from fairway.relay.events import Event, FinalEvent, TokenEvent, ToolEvent

DEFAULT_TTL_S = 1800.0  # 30 minutes: long enough for any reconnect, short enough to stay small
LISTENER_STALE_S = 10.0  # a listener whose process stopped heartbeating for this long is gone
# Past any log's last event: a reply's events are its tokens (at most the model's context length)
# and its tool events. The ids clients see are run * RUN_SPAN + n (gateway/cursor.py), and the Redis
# log publishes a restarted log's live events under those numbers too.
RUN_SPAN = 1 << 20


T = TypeVar("T")

# A subscriber's synchronous fast path: takes the next token event, as (n, text) (n = one past the
# last it took or was yielded; its token ids are not parsed for it), and returns True, or returns
# False when it cannot take it now; the event is then yielded as usual, and so is everything after
# it until the iterator waits again. What it does with the event is its own (the gateway writes it
# to the client). A sink type in C may also offer the C-level form of this call
# (fairway/csrc/token_sink.h), which the Redis backend's dispatcher then uses.
TokenSink = Callable[[int, str], bool]


def check_after(reply_id: str, after: int, last_n: int, finished: bool) -> None:
    """Reject cursors no client could hold: negative, or past the end of a finished reply.

    Past the end of a running reply is allowed: it just waits for those events to arrive.
    """
    if after < 0:
        raise ValueError(f"after must be >= 0, got {after}")
    if finished and after > last_n:
        raise EventIdOutOfRange(reply_id, after, last_n)


def check_run(reply_id: str, run: int | None, held: int | None) -> None:
    """A reader of run `run` of a log that holds run `held`: LogReplaced when the log holds a later
    run, made after the reader's was lost. An earlier run is the reader's to read: each run's log
    is made once (its restart's claim is a compare-and-set), and a gateway whose claim came after
    another's, just before that one made its log, counted a run it then found a log for (restart()
    gives up there). None on either side agrees with anything: a reader of whatever run is there
    (a replica resuming the log), or a log whose run nobody said (made by an append, or by a
    gateway of the previous version, which wrote no run)."""
    if run is not None and held is not None and held > run:
        raise LogReplaced(reply_id, run, held)


def check_producer_run(reply_id: str, run: int | None, held: int | None) -> None:
    """A producer of run `run` appending to a log that holds run `held` (None: not said, which is
    run 0): RunReplaced unless they are the same run. None for `run` agrees with anything: a
    producer whose job did not say its run (a gateway of the previous version)."""
    if run is not None and run != (held or 0):
        raise RunReplaced(reply_id, run, held or 0)


def producer_runs(items: Sequence[object], runs: Sequence[int | None] | None) -> Sequence[int | None]:
    """append_many()'s runs, one for each item (None for all when not given)."""
    if runs is None:
        return [None] * len(items)
    if len(runs) != len(items):
        raise ValueError(f"{len(runs)} runs for {len(items)} events")
    return runs


def check_token_events(items: Sequence[tuple[str, TokenEvent | ToolEvent]]) -> None:
    """append_many() takes token and tool events only: the terminal event goes through finish()."""
    for _, event in items:
        if not isinstance(event, TokenEvent | ToolEvent):
            raise TypeError("append() takes a TokenEvent or ToolEvent; use finish() for the terminal event")


def raise_if_error(result: T | Exception) -> T:
    """One result of a batched call (append_many()'s, say): the value, or its error raised."""
    if isinstance(result, Exception):
        raise result
    return result


class TokenLog(ABC):
    """One small async interface over the in-process and Redis backends (see make_relay)."""

    ttl_s: float

    # -- the log -----------------------------------------------------------------------------

    @abstractmethod
    async def create(self, reply_id: str, run: int = 0) -> bool:
        """Open an empty log so subscribers can attach before the first token; also starts the
        listener idle clock. run: which run of the reply it holds (Reply.restarts; 0 for the
        first). Returns False (and changes nothing) if the log already exists."""

    async def append(self, reply_id: str, event: TokenEvent | ToolEvent, run: int | None = None) -> int:
        """Append one token (or tool) event and return its n. event.n == 0 takes the next number; any other
        n must be exactly last+1 (EventOutOfOrder otherwise, so a duplicate or zombie producer
        cannot corrupt the log). run: the producer's run of the reply (its job's), checked with
        the order, atomically: RunReplaced from a log of another run (check_producer_run); None
        checks nothing. Creates the log if missing (of the producer's run); ReplyFinished after
        finish()."""
        return raise_if_error((await self.append_many([(reply_id, event)], [run]))[0])

    @abstractmethod
    async def append_many(self, items: Sequence[tuple[str, TokenEvent | ToolEvent]],
                          runs: Sequence[int | None] | None = None) -> list[int | Exception]:
        """append() for many (reply id, event) pairs at once, in one round trip where the backend
        has them: a replica appends one engine step's tokens for all its replies together. runs:
        each pair's producer run (append()'s run), None: no check for any. Each pair's n, or the
        relay error append() would have raised for it, in its place; an outage
        (RelayUnavailable) raises for all of them."""

    @abstractmethod
    async def finish(self, reply_id: str, final: FinalEvent, run: int | None = None) -> int:
        """Append the terminal event (same numbering and run rules as append) and return its n."""

    @abstractmethod
    async def read(self, reply_id: str, after: int = 0, run: int | None = None) -> list[Event]:
        """Every event with n > after, right now. ReplyNotFound for an unknown/expired reply (and
        LogReplaced, one, when the log holds another run than `run`, see check_run),
        EventIdOutOfRange when after is past the end of a finished reply."""

    async def subscribe(self, reply_id: str, after: int = 0, run: int | None = None) -> AsyncIterator[Event]:
        """Events with n > after: the logged ones at once, then live, ending after the terminal
        event. Same errors as read(), raised on the first iteration; once it iterates, the events
        are those of the log it first read, never another's under the same id: a log lost and
        made again meanwhile ends it with LogReplaced (with ReplyNotFound where the backend cannot
        tell). The subscriber counts as a listener while it iterates; wrap it in
        contextlib.aclosing() so leaving is recorded at once rather than at garbage collection."""
        async with aclosing(self.subscribe_batches(reply_id, after, run=run)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    @abstractmethod
    def subscribe_batches(
        self, reply_id: str, after: int = 0, idle_s: float | None = None, direct: TokenSink | None = None,
        run: int | None = None,
    ) -> AsyncIterator[list[Event]]:
        """subscribe() as the batches the events arrive in (the replay is one), so a writer can
        send all that came together at once. With idle_s, an empty batch after each idle_s (give
        or take a second) without events, for keepalives.

        With direct, the backend may hand a token event to it, in order, instead of yielding it:
        only while the iterator is waiting for events (its consumer has dealt with everything
        before), from the callback where the event arrives. That spares the consumer's task a wake
        per event (Redis backend; the in-process one yields everything)."""

    async def exists(self, reply_id: str) -> bool:
        """Whether the reply's log is there (created and not yet expired)."""
        return (await self.exists_many([reply_id]))[0]

    @abstractmethod
    async def exists_many(self, reply_ids: Sequence[str]) -> list[bool]:
        """exists() for each of these replies, in one round trip (a sweep over many replies)."""

    @abstractmethod
    async def last_event_id(self, reply_id: str) -> int:
        """n of the newest event (0 for a created, empty log); ReplyNotFound if none."""

    # -- listeners ---------------------------------------------------------------------------

    @abstractmethod
    async def listener_count(self, reply_id: str) -> int:
        """Subscribers iterating this reply now, across all gateways."""

    @abstractmethod
    async def listener_idle_many(self, reply_ids: Sequence[str]) -> list[float | None]:
        """Seconds nobody has been listening to each reply (0.0 while someone does; None for an
        unknown reply), in one round trip for all where the backend has them. Measured on one
        clock (the Redis server's for Redis), so the replica's "30 s" is immune to skew between
        machines."""

    async def listener_idle_s(self, reply_id: str) -> float | None:
        """listener_idle_many() of one reply."""
        return (await self.listener_idle_many([reply_id]))[0]

    # -- control -----------------------------------------------------------------------------

    @abstractmethod
    async def request_stop(self, reply_id: str) -> bool:
        """Ask the producer to stop the reply. True if it was still running (stop pending), False
        if it already ended. ReplyNotFound for an unknown reply."""

    @abstractmethod
    async def stop_requested(self, reply_id: str) -> bool:
        """Whether a stop was requested for the reply (kept as long as the log)."""

    @abstractmethod
    def watch_stops(self) -> AsyncIterator[str]:
        """Reply ids of every stop requested from the moment this iteration starts, from any
        gateway. A replica filters for its own replies; for replies it adopted earlier (e.g. after
        failover) it checks stop_requested() once."""

    async def close(self) -> None:  # noqa: B027  (only the Redis log has tasks to stop)
        """Stop what the log runs in the background; the in-process log runs nothing."""
