"""The relay's three contracts (token log, job queue, inbox), each run against both of its
implementations (in-process, and the real Redis server)."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest
from backends import missing
from redis_keys import delete_prefixed
from transports import RecordingTransport, dechunk, token_of

from fairway.gateway import token_writer
from fairway.gateway.sse import ReplyView, token_template
from fairway.redis_client import dispatch
from fairway.relay import (
    ClaimedJob,
    EventIdOutOfRange,
    EventOutOfOrder,
    FinalEvent,
    Inbox,
    InProcessInbox,
    InProcessJobQueue,
    InProcessTokenLog,
    JobQueue,
    Lane,
    Relay,
    RelayUnavailable,
    ReplyFinished,
    ReplyNotFound,
    ReplyState,
    TokenEvent,
    TokenLog,
    event_from_fields,
    make_relay,
)
from fairway.relay.inbox_redis import RedisInbox
from fairway.relay.job_queue_redis import RedisJobQueue
from fairway.relay.token_log_redis import RedisTokenLog

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
VIEW = ReplyView("rep_1", "conv_1", "msg_1", "smollm2", 1796060482)  # what a token writer's chunks say


class Backend:
    """Opens views of one relay: for Redis each open() is a separate client, as a separate gateway
    or replica process would have; in-process there is only the one object to share."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind  # memory, redis or cluster (a local Redis Cluster of three masters)
        self.url = url or REDIS_URL
        self.prefix = f"test:{uuid.uuid4().hex[:12]}:"  # isolates this test's keys on the shared server
        self._relays: list[Relay] = []

    def relay(self, **options: Any) -> Relay:
        if self.kind == "memory":
            if not self._relays:
                self._relays.append(make_relay(None, **options))
            return self._relays[0]
        relay = make_relay(self.url, prefix=self.prefix, **options)
        self._relays.append(relay)
        return relay

    def log(self, **options: Any) -> TokenLog:
        return self.relay(**options).log

    def jobs(self, **options: Any) -> JobQueue:
        return self.relay(**options).jobs

    def inbox(self, **options: Any) -> Inbox:
        return self.relay(**options).inbox

    async def cleanup(self) -> None:
        if self.kind == "redis":  # (the cluster lives for the session only)
            await delete_prefixed(REDIS_URL, self.prefix)
        for relay in self._relays:
            await relay.close()


async def _started(kind: str, url: str | None = None) -> Backend:
    b = Backend(kind, url)
    if kind == "redis":
        try:
            await b.relay().ping()
        except RelayUnavailable:
            for relay in b._relays:  # (no keys to delete: there is no server)
                await relay.close()
            missing("Redis", f"nothing answers at {REDIS_URL}")
    return b


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else None
    b = await _started(request.param, url)
    yield b
    await b.cleanup()


@pytest.fixture
async def redis_backend() -> AsyncIterator[Backend]:
    b = await _started("redis")
    yield b
    await b.cleanup()


def rid() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


def final(
    n: int = 0, state: ReplyState = ReplyState.FINISHED, reason: str = "stop", **usage: Any
) -> FinalEvent:
    return FinalEvent(n, reason, state, **usage)  # type: ignore[arg-type]


async def collect(log: TokenLog, reply_id: str, after: int = 0) -> list[Any]:
    async with aclosing(log.subscribe(reply_id, after)) as events:
        return [event async for event in events]


async def produce(log: TokenLog, reply_id: str, count: int, start: int = 1) -> None:
    for n in range(start, start + count):
        await log.append(reply_id, TokenEvent(n, f"t{n} ", [n]))


# -- events --------------------------------------------------------------------------------


def test_events_round_trip_flat_fields() -> None:
    events = [
        TokenEvent(1, 'héllo, "world"\n', [15, 2, 99]),
        TokenEvent(2, "", []),
        final(
            3, ReplyState.FLAGGED, "content_filter", prompt_tokens=10, cached_tokens=4, completion_tokens=2
        ),
        final(4, ReplyState.SHED, "abort", error="free tier at capacity"),
    ]
    for event in events:
        fields = event.to_fields()
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
        assert event_from_fields(fields) == event


def test_final_event_rejects_bad_reason_and_non_terminal_state() -> None:
    with pytest.raises(ValueError):
        final(1, reason="done")
    with pytest.raises(ValueError):
        final(1, state=ReplyState.RUNNING)
    with pytest.raises(ValueError):
        event_from_fields({"k": "x", "n": "1"})


def test_make_relay_picks_backend() -> None:
    relay = make_relay(None)
    assert isinstance(relay.log, InProcessTokenLog)
    assert isinstance(relay.jobs, InProcessJobQueue) and isinstance(relay.inbox, InProcessInbox)
    assert make_relay("memory://", ttl_s=5).log.ttl_s == 5
    relay = make_relay(REDIS_URL)
    assert isinstance(relay.log, RedisTokenLog)
    assert isinstance(relay.jobs, RedisJobQueue) and isinstance(relay.inbox, RedisInbox)
    with pytest.raises(ValueError):
        make_relay("kafka://x")


# -- the log -------------------------------------------------------------------------------


async def test_append_and_read_in_order(backend: Backend) -> None:
    log, r = backend.log(), rid()
    assert await log.create(r) is True
    assert await log.create(r) is False  # idempotent: a second create changes nothing
    assert await log.last_event_id(r) == 0
    assert await log.read(r) == []
    assert await log.append(r, TokenEvent(0, "Hel", [1])) == 1  # n=0: assigned
    assert await log.append(r, TokenEvent(2, "lo", [2, 3])) == 2  # explicit n: validated
    assert await log.append(r, TokenEvent(0, "!", [])) == 3
    events = await log.read(r)
    assert [e.n for e in events] == [1, 2, 3]
    assert "".join(e.text for e in events) == "Hello!"
    assert events[1].token_ids == [2, 3]
    assert [e.n for e in await log.read(r, after=2)] == [3]
    assert await log.read(r, after=3) == []
    assert await log.read(r, after=7) == []  # running reply: nothing yet, not an error
    assert await log.finish(r, final(0, completion_tokens=4)) == 4
    assert await log.last_event_id(r) == 4
    end = (await log.read(r, after=3))[0]
    assert isinstance(end, FinalEvent) and end.state is ReplyState.FINISHED and end.completion_tokens == 4


async def test_append_creates_missing_log_and_enforces_numbering(backend: Backend) -> None:
    log, r = backend.log(), rid()
    assert await log.append(r, TokenEvent(1, "a")) == 1  # a producer may start without create()
    assert await log.exists(r)
    with pytest.raises(EventOutOfOrder):
        await log.append(r, TokenEvent(1, "dup"))  # a duplicate (zombie producer) is refused
    with pytest.raises(EventOutOfOrder):
        await log.append(r, TokenEvent(3, "gap"))
    zombie = rid()
    with pytest.raises(EventOutOfOrder):
        await log.append(zombie, TokenEvent(5, "zombie"))  # no log, and 5 is not a first event
    assert not await log.exists(zombie)  # (nor does the refusal leave one behind)
    await log.finish(r, final())
    with pytest.raises(ReplyFinished):
        await log.append(r, TokenEvent(0, "late"))
    with pytest.raises(ReplyFinished):
        await log.finish(r, final())
    with pytest.raises(TypeError):
        await log.append(r, final())  # type: ignore[arg-type]
    assert [e.n for e in await log.read(r)] == [1, 2]


async def test_append_many_appends_each_and_puts_errors_in_place(backend: Backend) -> None:
    log, a, b = backend.log(), rid(), rid()
    await log.append(a, TokenEvent(1, "a1"))
    results = await log.append_many([(a, TokenEvent(2, "a2")), (b, TokenEvent(0, "b1")), (a, TokenEvent(2, "dup"))])
    assert results[:2] == [2, 1] and isinstance(results[2], EventOutOfOrder)  # one reply's error spares the rest
    await log.finish(b, final())
    results = await log.append_many([(b, TokenEvent(0, "late")), (a, TokenEvent(0, "a3"))])
    assert isinstance(results[0], ReplyFinished) and results[1] == 3
    assert [e.text for e in await log.read(a)] == ["a1", "a2", "a3"]
    assert [e.n for e in await log.read(b)] == [1, 2]  # "late" never got in
    with pytest.raises(TypeError):
        await log.append_many([(a, final())])  # type: ignore[list-item]


async def test_a_step_bigger_than_one_append_call_lands_in_order_with_errors_in_place(backend: Backend) -> None:
    """A replica's step of 201 events over five replies (more than one append call takes: on Redis
    they go in several, on a cluster by slot): each reply's events land numbered in order, a
    duplicate and a finished reply's tokens fail alone, in their places."""
    from fairway.relay.token_log_redis import APPENDS_PER_CALL

    log, replies = backend.log(), [rid() for _ in range(5)]
    for r in replies:
        await log.create(r)
    await log.finish(replies[4], final())
    items = [(r, TokenEvent(0, f"{k}", [k])) for k in range(40) for r in replies]
    items.insert(77, (replies[0], TokenEvent(1, "dup")))  # replies[0] has 16 events by then
    assert len(items) > 3 * APPENDS_PER_CALL
    results = await log.append_many(items)
    assert isinstance(results[77], EventOutOfOrder) and results[77].last_n == 16
    rest = results[:77] + results[78:]
    assert len(rest[4::5]) == 40 and all(isinstance(x, ReplyFinished) for x in rest[4::5])
    for j, r in enumerate(replies[:4]):
        assert rest[j::5] == list(range(1, 41))
        assert [(e.n, e.text) for e in await log.read(r)] == [(k + 1, f"{k}") for k in range(40)]
    assert [e.n for e in await log.read(replies[4])] == [1]


async def test_exists_many_answers_for_each_reply_in_its_place(backend: Backend) -> None:
    """A sweep over many unfinished replies asks for their logs at once (on a cluster, their keys
    lie on several masters)."""
    log = backend.log()
    replies = [rid() for _ in range(12)]
    for r in replies[::2]:
        await log.create(r)
    await log.finish(replies[0], final())  # a finished log is still there
    assert await log.exists_many(replies) == [i % 2 == 0 for i in range(12)]
    assert await log.exists_many([]) == []


async def test_unknown_reply_and_bad_cursor_errors(backend: Backend) -> None:
    log, r = backend.log(), rid()
    assert not await log.exists(r)
    for call in (log.read(r), collect(log, r), log.last_event_id(r), log.request_stop(r)):
        with pytest.raises(ReplyNotFound):
            await call
    await produce(log, r, 3)
    await log.finish(r, final())  # n = 4
    with pytest.raises(EventIdOutOfRange):
        await log.read(r, after=5)
    with pytest.raises(EventIdOutOfRange):
        await collect(log, r, after=5)
    with pytest.raises(ValueError):
        await log.read(r, after=-1)
    assert await log.read(r, after=4) == []  # saw the terminal event: nothing more, no error


async def test_subscribe_replays_finished_reply_and_ends(backend: Backend) -> None:
    log, r = backend.log(), rid()
    await produce(log, r, 5)
    await log.finish(r, final())
    assert [e.n for e in await collect(log, r)] == [1, 2, 3, 4, 5, 6]
    assert [e.n for e in await collect(log, r, after=4)] == [5, 6]
    assert [e.n for e in await collect(log, r, after=5)] == [6]
    assert await collect(log, r, after=6) == []


async def test_subscribe_before_first_token_goes_live(backend: Backend) -> None:
    gateway, replica, r = backend.log(), backend.log(), rid()
    await gateway.create(r)
    listener = asyncio.create_task(collect(gateway, r))
    await asyncio.sleep(0.05)
    await produce(replica, r, 3)
    await replica.finish(r, final())
    events = await asyncio.wait_for(listener, 5)
    assert [e.n for e in events] == [1, 2, 3, 4] and isinstance(events[-1], FinalEvent)


async def test_subscribe_at_random_points_gets_no_gap_and_no_duplicate(backend: Backend) -> None:
    """500 tokens from one process; subscribers join another process at random points."""
    replica, gateway, r = backend.log(), backend.log(), rid()
    rng = random.Random(7)
    total = 500
    await replica.create(r)
    listeners: list[tuple[int, asyncio.Task[list[Any]]]] = []
    for n in range(1, total + 1):
        await replica.append(r, TokenEvent(n, f"<{n}>", [n]))
        if n % 20 == 0 or rng.random() < 0.02:
            after = rng.randint(0, n)
            listeners.append((after, asyncio.create_task(collect(gateway, r, after))))
        if n % 5 == 0:
            await asyncio.sleep(0)  # let subscribers interleave with the producer
    await replica.finish(r, final(completion_tokens=total))
    assert len(listeners) >= 25
    for after, task in listeners:
        events = await asyncio.wait_for(task, 10)
        assert [e.n for e in events] == list(range(after + 1, total + 2)), f"subscriber after {after}"
        assert all(e.text == f"<{e.n}>" for e in events[:-1])


def quick(backend: Backend) -> dict[str, float]:
    """Options for a backend that checks idleness and expiry several times a second."""
    return {"poll_s": 0.05} if backend.kind == "memory" else {"block_s": 0.2}


async def test_subscribe_batches_and_keepalives(backend: Backend) -> None:
    gateway, replica, r = backend.log(**quick(backend)), backend.log(), rid()
    await replica.create(r)
    batches: list[list[Any]] = []

    async def listen() -> None:
        async with aclosing(gateway.subscribe_batches(r, 0, idle_s=0.3)) as stream:
            async for batch in stream:
                batches.append(batch)
                if batch and isinstance(batch[-1], FinalEvent):
                    return

    task = asyncio.create_task(listen())
    await asyncio.sleep(0.1)
    await replica.append_many([(r, TokenEvent(1, "a", [1])), (r, TokenEvent(2, "b", [2]))])
    await asyncio.sleep(1.0)  # quiet: the listener gets empty batches to send keepalives on
    await replica.finish(r, final())
    await asyncio.wait_for(task, 5)
    assert [e.n for batch in batches for e in batch] == [1, 2, 3]
    assert [] in batches[batches.index(next(b for b in batches if b)) :]


@pytest.mark.parametrize("sink", ["function", "writer-native", "writer-python"])
async def test_a_direct_sink_takes_live_tokens_in_order_and_hands_back_what_it_refuses(
        backend: Backend, sink: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's fast path: while the subscriber waits, the backend may hand token events to
    `direct` instead of yielding them. Together, what direct took and what was yielded are every
    event once, in order; a refused event (a paused connection) and everything after it until the
    iterator waits again come through the iterator; the final event always does. The SSE relay's
    sink is the gateway's token writer, which the Redis backend's dispatcher hands events to itself
    (in C through the writer's C-level sink protocol, or all in Python), keeping the text of what
    it wrote; a plain function is called."""
    if sink == "writer-python":
        monkeypatch.setattr(dispatch, "native_module", lambda: None)
        monkeypatch.setattr(token_writer, "native_module", lambda: None)
    elif sink == "writer-native" and (dispatch.native_module() is None or token_writer.native_module() is None):
        pytest.skip("no C compiler")
    gateway, replica, r = backend.log(), backend.log(), rid()
    await replica.create(r)
    await replica.append(r, TokenEvent(1, "replayed", [1]))
    order: list[tuple[str, int]] = []  # ("direct" | "yielded", n) in the order the consumer saw them
    refuse = {6, 7}

    def direct(n: int, text: str) -> bool:
        if n in refuse:
            return False
        assert text == f"<{n}>"  # the event's text, as appended
        order.append(("direct", n))
        return True

    def offered() -> int:  # the event a writer is offered next: one past all the consumer saw
        return max((n for _, n in order), default=0) + 1

    def backlog() -> int:  # the writer's connection refuses the events `direct` refuses
        return int(offered() in refuse)

    transport = RecordingTransport(backlog)
    transport.write = lambda data: order.append(("direct", token_of(dechunk(data)[0])[0]))  # type: ignore[method-assign]
    writer = token_writer.make_writer(token_template(VIEW), transport)

    async def listen() -> None:
        async with aclosing(gateway.subscribe_batches(r, 0, None, direct if sink == "function" else writer)) as stream:
            async for batch in stream:
                order.extend(("yielded", e.n) for e in batch)
                # A token the sink refused comes through whole, its ids parsed.
                assert all(e.token_ids == [e.n] for e in batch if isinstance(e, TokenEvent))
                if batch and isinstance(batch[-1], FinalEvent):
                    return

    task = asyncio.create_task(listen())
    await asyncio.sleep(0.2)
    total = 12
    for n in range(2, total + 1):  # one event per "engine step", as a replica sends them
        await replica.append_many([(r, TokenEvent(n, f"<{n}>", [n]))])
        await asyncio.sleep(0.02)
    await replica.finish(r, final(completion_tokens=total))
    await asyncio.wait_for(task, 5)
    assert [n for _, n in order] == list(range(1, total + 2))
    kinds = dict((n, kind) for kind, n in order)
    assert kinds[1] == "yielded" and kinds[total + 1] == "yielded"  # the replay, and the final event
    assert kinds[6] == "yielded" and kinds[7] == "yielded"  # refused: the iterator has them
    taken = {n for n, kind in kinds.items() if kind == "direct"}
    if backend.kind != "memory":
        assert taken >= set(range(2, 6)) | set(range(9, total + 1))
    else:  # the in-process backend yields everything
        assert not taken
    assert writer.text() == ("" if sink == "function" else "".join(f"<{n}>" for n in sorted(taken)))


async def test_two_writers_on_one_reply_in_one_gateway_each_get_every_event_once(redis_backend: Backend) -> None:
    """A second listener of a reply in the same gateway (two tabs): the dispatcher stops handing
    events to the first one's writer, and both get every event once, in order, through writer or
    iterator."""
    gateway, replica, r = redis_backend.log(), redis_backend.log(), rid()
    await replica.create(r)
    seen: dict[str, list[int]] = {"a": [], "b": []}

    async def listen(name: str) -> None:
        transport = RecordingTransport()
        transport.write = lambda data: seen[name].append(token_of(dechunk(data)[0])[0])  # type: ignore[method-assign]
        writer = token_writer.make_writer(token_template(VIEW), transport)
        async with aclosing(gateway.subscribe_batches(r, 0, None, writer)) as stream:
            async for batch in stream:
                seen[name].extend(e.n for e in batch)
                if batch and isinstance(batch[-1], FinalEvent):
                    return

    first = asyncio.create_task(listen("a"))
    await asyncio.sleep(0.2)
    second = None
    for n in range(1, 21):
        await replica.append_many([(r, TokenEvent(n, f"<{n}>", [n]))])
        await asyncio.sleep(0.02)
        if n == 8:
            second = asyncio.create_task(listen("b"))
    await replica.finish(r, final(completion_tokens=20))
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert seen["a"] == seen["b"] == list(range(1, 22))


async def test_a_log_that_expires_under_a_subscriber_ends_it_with_not_found(backend: Backend) -> None:
    log, r = backend.log(ttl_s=0.5, **quick(backend)), rid()
    await log.create(r)
    await log.append(r, TokenEvent(0, "x"))
    seen: list[int] = []
    with pytest.raises(ReplyNotFound):
        async with aclosing(log.subscribe(r)) as events:
            async for event in events:
                seen.append(event.n)
    assert seen == [1]


async def test_expiry_after_ttl_counts_from_last_event(backend: Backend) -> None:
    log, r = backend.log(ttl_s=0.4), rid()
    await log.create(r)
    for _ in range(3):  # each append restarts the retention clock
        await asyncio.sleep(0.2)
        await log.append(r, TokenEvent(0, "x"))
    assert await log.exists(r)
    await log.finish(r, final())
    await asyncio.sleep(0.6)
    assert not await log.exists(r)
    with pytest.raises(ReplyNotFound):
        await log.read(r)


async def test_stop_request_reaches_the_producer_from_any_instance(backend: Backend) -> None:
    replica, edge, r, other = backend.log(), backend.log(), rid(), rid()
    await replica.create(r)
    await replica.create(other)
    seen: list[str] = []

    async def watch() -> None:
        async with aclosing(replica.watch_stops()) as stops:
            async for reply_id in stops:
                seen.append(reply_id)
                if reply_id == r:
                    return

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.05)  # the watcher has started
    assert not await replica.stop_requested(r)
    assert await edge.request_stop(r) is True
    await asyncio.wait_for(watcher, 5)
    assert seen == [r]
    assert await replica.stop_requested(r)
    assert not await replica.stop_requested(other)
    await replica.finish(r, final(state=ReplyState.STOPPED, reason="abort"))
    await replica.finish(other, final())
    assert await edge.request_stop(other) is False  # already over: nothing to stop


async def test_listener_tracking_across_instances(backend: Backend) -> None:
    replica, edge, r = backend.log(), backend.log(), rid()
    assert await replica.listener_count(r) == 0
    assert await replica.listener_idle_s(r) is None  # no such reply
    await edge.create(r)
    await asyncio.sleep(0.1)
    idle = await replica.listener_idle_s(r)
    assert idle is not None and 0.05 <= idle < 5  # counts from create() when nobody came

    got = asyncio.Event()

    async def listen() -> None:
        async with aclosing(edge.subscribe(r)) as events:
            async for _ in events:
                got.set()

    task = asyncio.create_task(listen())
    await replica.append(r, TokenEvent(0, "a"))
    await asyncio.wait_for(got.wait(), 5)
    assert await replica.listener_count(r) == 1
    assert await replica.listener_idle_s(r) == 0.0
    assert await replica.listener_idle_many([r, rid()]) == [0.0, None]
    before = time.time()
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await replica.listener_count(r) == 0
    gone = await replica.listener_idle_s(r)
    assert gone is not None and gone < time.time() - before + 2  # counts from when the listener left
    await asyncio.sleep(0.15)
    idle = await replica.listener_idle_s(r)
    assert idle is not None and idle >= 0.1


async def test_launch_opens_the_log_and_then_queues_the_job(backend: Backend) -> None:
    gateway, replica, r = backend.relay(), backend.relay(), rid()
    q = f"q{uuid.uuid4().hex[:6]}"
    job_id = await gateway.launch(r, {"reply_id": r, "model": "m"}, Lane.PAID, queue=q)
    assert await replica.log.exists(r) and await replica.log.last_event_id(r) == 0  # listeners may attach now
    claimed = await replica.jobs.claim(queue=q)
    assert claimed == ClaimedJob(job_id, Lane.PAID, {"reply_id": r, "model": "m"})
    assert await replica.jobs.claim(queue=q) is None


async def test_bus_claims_paid_before_free_before_background(backend: Backend) -> None:
    gateway, replica = backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    await gateway.submit({"reply": "bg1"}, Lane.BACKGROUND, queue=q)
    await gateway.submit({"reply": "free1"}, "free", queue=q)
    await gateway.submit({"reply": "paid1"}, Lane.PAID, queue=q)
    await gateway.submit({"reply": "free2"}, Lane.FREE, queue=q)
    await gateway.submit({"reply": "paid-resume"}, Lane.PAID, queue=q, front=True)  # failover continuation
    assert await replica.depth(queue=q) == {Lane.PAID: 2, Lane.FREE: 2, Lane.BACKGROUND: 1}
    order = []
    while (job := await replica.claim(queue=q)) is not None:
        order.append((job.lane, job.job["reply"]))
    assert order == [
        (Lane.PAID, "paid-resume"),
        (Lane.PAID, "paid1"),
        (Lane.FREE, "free1"),
        (Lane.FREE, "free2"),
        (Lane.BACKGROUND, "bg1"),
    ]
    start = time.monotonic()
    assert await replica.claim(queue=q, timeout=0.2) is None
    assert 0.15 <= time.monotonic() - start < 2


async def test_bus_claims_a_batch_from_the_first_lane_with_work(backend: Backend) -> None:
    gateway, consumer = backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    for i in range(5):
        await gateway.submit({"n": i}, Lane.FREE, queue=q)
    await gateway.submit({"n": "paid"}, Lane.PAID, queue=q)
    assert [j.job["n"] for j in await consumer.claim_many(queue=q, max_count=10)] == ["paid"]
    assert [j.job["n"] for j in await consumer.claim_many(queue=q, max_count=3)] == [0, 1, 2]
    assert [(j.lane, j.job["n"]) for j in await consumer.claim_many(queue=q, max_count=3, timeout=None)] == [
        (Lane.FREE, 3), (Lane.FREE, 4)]
    start = time.monotonic()
    assert await consumer.claim_many(queue=q, max_count=3, timeout=0.2) == []
    assert 0.15 <= time.monotonic() - start < 2
    waiting = asyncio.create_task(consumer.claim_many(queue=q, max_count=3, timeout=5))
    await asyncio.sleep(0.05)
    await gateway.submit({"n": "late"}, Lane.BACKGROUND, queue=q)
    assert [j.job["n"] for j in await asyncio.wait_for(waiting, 5)] == ["late"]


async def test_a_claimed_job_stays_in_its_queue_until_acknowledged(backend: Backend) -> None:
    """At least once: what a replica claimed is still there for a failover if it dies before
    acking; unfinished() lists it (claimed first, then what waits), ack() removes it."""
    gateway, replica, failover = backend.jobs(), backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    for n in ("a", "b", "c"):
        await gateway.submit({"n": n}, Lane.FREE, queue=q)
    await gateway.submit({"n": "bg"}, Lane.BACKGROUND, queue=q)
    running = await replica.claim_many(queue=q, max_count=2)
    assert [j.job["n"] for j in running] == ["a", "b"]
    assert await replica.depth(queue=q) == {Lane.PAID: 0, Lane.FREE: 1, Lane.BACKGROUND: 1}
    left = await failover.unfinished(queue=q)
    assert [(j.lane, j.job["n"]) for j in left] == [(Lane.FREE, "a"), (Lane.FREE, "b"), (Lane.FREE, "c"),
                                                   (Lane.BACKGROUND, "bg")]
    assert [j.job["n"] for j in await failover.unfinished(queue=q, part="waiting")] == ["c", "bg"]
    # What a replica restarted under its id asks for: its own claims (ReplicaWorker._resume_own).
    assert [j.job["n"] for j in await backend.jobs().unfinished(queue=q, part="claimed")] == ["a", "b"]
    await replica.ack(running[:1], queue=q)  # "a" ended
    assert [j.job["n"] for j in await failover.unfinished(queue=q)] == ["b", "c", "bg"]
    # A failover hands on "b" (claimed) and "c" (waiting), acking each in the dead queue.
    await failover.ack([j for j in left if j.job["n"] in ("b", "c")], queue=q)
    assert [j.job["n"] for j in await failover.unfinished(queue=q)] == ["bg"]
    assert [j.job["n"] for j in await replica.claim_many(queue=q, max_count=5)] == ["bg"]  # never "c" again
    await failover.delete(queue=q)
    assert await failover.unfinished(queue=q) == []
    assert await replica.claim(queue=q) is None


async def test_a_claim_can_take_from_some_lanes_only_in_its_own_order(backend: Backend) -> None:
    """A replica whose seats are full takes paid work only; one whose background work has waited
    too long takes that first (fairway/replica/seats.py). Either acks like any claim."""
    gateway, replica = backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    await gateway.submit({"n": "free"}, Lane.FREE, queue=q)
    await gateway.submit({"n": "bg"}, Lane.BACKGROUND, queue=q)
    start = time.monotonic()
    assert await replica.claim(queue=q, timeout=0.2, lanes=(Lane.PAID,)) is None  # free waits: none paid
    assert 0.15 <= time.monotonic() - start < 2
    waiting = asyncio.create_task(replica.claim(queue=q, timeout=5, lanes=(Lane.PAID,)))
    await asyncio.sleep(0.05)
    await gateway.submit({"n": "paid"}, Lane.PAID, queue=q, front=True)
    paid = await asyncio.wait_for(waiting, 5)
    assert paid is not None and (paid.lane, paid.job["n"]) == (Lane.PAID, "paid")
    aged = await replica.claim(queue=q, lanes=(Lane.BACKGROUND, Lane.PAID, Lane.FREE))
    assert aged is not None and (aged.lane, aged.job["n"]) == (Lane.BACKGROUND, "bg")
    await replica.ack([paid, aged], queue=q)
    assert [j.job["n"] for j in await replica.unfinished(queue=q)] == ["free"]


async def test_a_claim_after_one_that_emptied_the_queue_misses_nothing(backend: Backend) -> None:
    """A replica's claim loop claims again right after a job; what came in meanwhile, in any lane,
    is claimed at once and in lane order, whether the claim waits or not, and a job another
    consumer of the queue took is not waited for."""
    gateway, replica, other = backend.jobs(), backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    await gateway.submit({"n": "a"}, Lane.FREE, queue=q)
    assert (await replica.claim(queue=q)).job["n"] == "a"  # type: ignore[union-attr]  (the queue is empty now)
    await gateway.submit({"n": "b"}, Lane.FREE, queue=q)
    await gateway.submit({"n": "c"}, Lane.PAID, queue=q, front=True)
    start = time.monotonic()
    got = [await asyncio.wait_for(replica.claim(queue=q, timeout=None), 5), await replica.claim(queue=q, timeout=5)]
    assert [j.job["n"] for j in got if j] == ["c", "b"] and time.monotonic() - start < 1
    assert await replica.claim(queue=q, timeout=0.2) is None
    await gateway.submit({"n": "d"}, Lane.BACKGROUND, queue=q)
    assert (await replica.claim(queue=q, timeout=0)).job["n"] == "d"  # type: ignore[union-attr]
    # Seats full: paid only. A free job is not taken, and the next full claim takes it at once.
    assert await replica.claim(queue=q, timeout=0.2, lanes=(Lane.PAID,)) is None
    await gateway.submit({"n": "e"}, Lane.FREE, queue=q)
    assert await replica.claim(queue=q, timeout=0.2, lanes=(Lane.PAID,)) is None
    start = time.monotonic()
    assert (await asyncio.wait_for(replica.claim(queue=q, timeout=None), 5)).job["n"] == "e"  # type: ignore[union-attr]
    assert time.monotonic() - start < 1
    # Another consumer takes what came in: this one waits for the next job, then takes it.
    await gateway.submit({"n": "f"}, Lane.FREE, queue=q)
    assert (await other.claim(queue=q)).job["n"] == "f"  # type: ignore[union-attr]
    waiting = asyncio.create_task(replica.claim(queue=q, timeout=5))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await gateway.submit({"n": "g"}, Lane.PAID, queue=q)
    assert (await asyncio.wait_for(waiting, 5)).job["n"] == "g"  # type: ignore[union-attr]
    assert await replica.depth(queue=q) == {Lane.PAID: 0, Lane.FREE: 0, Lane.BACKGROUND: 0}


async def test_a_replys_end_posts_its_report_and_acknowledges_its_job(backend: Backend) -> None:
    """Relay.conclude, a replica's last word on a reply: the report is there for the recorders and
    the job is gone from the queue; with the queue deleted meanwhile (a failover emptied it) the
    report still goes."""
    gateway, replica, box = backend.relay(), backend.relay(), f"inbox{uuid.uuid4().hex[:6]}"
    q = f"q{uuid.uuid4().hex[:6]}"
    await gateway.jobs.submit({"n": 1}, Lane.FREE, queue=q)
    await gateway.jobs.submit({"n": 2}, Lane.PAID, queue=q)
    first, second = await replica.jobs.claim(queue=q), await replica.jobs.claim(queue=q)
    assert first is not None and second is not None
    await replica.conclude(box, {"reply": 2}, [first], queue=q)
    assert [j.job["n"] for j in await gateway.jobs.unfinished(queue=q)] == [1]
    await gateway.jobs.delete(queue=q)
    await replica.conclude(box, {"reply": 1}, [second], queue=q)
    assert [d.item for d in await gateway.inbox.take(box, "recorder", max_count=5)] == [{"reply": 2}, {"reply": 1}]
    assert await gateway.jobs.unfinished(queue=q) == []


async def test_bus_blocked_claim_wakes_on_submit(backend: Backend) -> None:
    gateway, replica = backend.jobs(), backend.jobs()
    q = f"q{uuid.uuid4().hex[:6]}"
    waiting = asyncio.create_task(replica.claim(queue=q, timeout=5))
    await asyncio.sleep(0.05)
    job_id = await gateway.submit({"reply": "r1", "prompt": [1, 2, 3]}, Lane.FREE, queue=q)
    job = await asyncio.wait_for(waiting, 5)
    assert job is not None and job.id == job_id and job.job == {"reply": "r1", "prompt": [1, 2, 3]}


async def test_inbox_keeps_what_a_consumer_took_until_it_acks(backend: Backend) -> None:
    """Reports' delivery: a taken item stays pending with its consumer; one left unacknowledged
    (its process died, its work failed) is reclaimed by any consumer once idle long enough."""
    replica, a, b = backend.inbox(), backend.inbox(), backend.inbox()
    box = f"inbox{uuid.uuid4().hex[:6]}"
    for i in range(3):
        await replica.post(box, {"n": i})  # (before anyone took from it: nothing is missed)
    first = await a.take(box, "a", max_count=2)
    assert [(d.item, d.attempts) for d in first] == [({"n": 0}, 1), ({"n": 1}, 1)]
    second = await b.take(box, "b", max_count=5, timeout=None)
    assert [d.item for d in second] == [{"n": 2}]
    assert await b.take(box, "b", max_count=5) == []  # taken is taken, acknowledged or not
    assert await b.reclaim(box, "b", min_idle_s=0.3, max_count=10) == []  # not idle long enough
    await a.ack(box, first[:1])
    await asyncio.sleep(0.35)
    again = await b.reclaim(box, "b", min_idle_s=0.3, max_count=10)
    assert sorted((d.item["n"], d.attempts) for d in again) == [(1, 2), (2, 2)]
    await b.ack(box, again)
    assert await a.reclaim(box, "a", min_idle_s=0, max_count=10) == []
    waiting = asyncio.create_task(a.take(box, "a", max_count=5, timeout=5))
    await asyncio.sleep(0.05)
    await replica.post(box, {"n": "late"})
    assert [d.item for d in await asyncio.wait_for(waiting, 5)] == [{"n": "late"}]
    assert await a.take(box, "a", max_count=5, timeout=0.1) == []


async def test_a_take_acknowledges_the_batch_before_it(backend: Backend) -> None:
    """A consumer's next look carries its last batch's acknowledgement: those items are gone (never
    reclaimed), the ones it did not name stay pending, and what it takes is as a plain take's, in a
    first look at an inbox nobody used yet too."""
    replica, consumer = backend.inbox(), backend.inbox()
    box = f"inbox{uuid.uuid4().hex[:6]}"
    assert await consumer.take(box, "c", max_count=5, acked=[]) == []  # (the first look makes the group)
    for i in range(3):
        await replica.post(box, {"n": i})
    first = await consumer.take(box, "c", max_count=3)
    await replica.post(box, {"n": 3})
    second = await consumer.take(box, "c", max_count=5, acked=first[:2])
    assert [d.item for d in second] == [{"n": 3}]
    assert await consumer.take(box, "c", max_count=5, timeout=0.1, acked=second) == []  # (acked, then waits)
    await asyncio.sleep(0.05)
    assert [d.item for d in await consumer.reclaim(box, "c", min_idle_s=0.01, max_count=10)] == [{"n": 2}]


async def test_inbox_forgets_consumers_long_gone(redis_backend: Backend) -> None:
    """Every gateway process takes reports under a name of its own: the inbox's group forgets a
    name that holds nothing and has not been used for consumer_gone_s (an hour by default)."""
    log = redis_backend.inbox(consumer_gone_s=0.2)
    box = f"inbox{uuid.uuid4().hex[:6]}"
    await log.post(box, {"n": 1})
    await log.ack(box, await log.take(box, "gone", max_count=1))
    await log.post(box, {"n": 2})
    assert len(await log.take(box, "holding", max_count=1)) == 1  # (never acknowledged)
    await asyncio.sleep(0.3)
    assert await log.reclaim(box, "new", min_idle_s=10, max_count=1) == []
    key = f"{redis_backend.prefix}inbox:{{{box}}}"
    consumers = await log._client.execute("XINFO", "CONSUMERS", key, "consumers")  # type: ignore[attr-defined]
    assert [dict(zip(c[::2], c[1::2], strict=True))["name"] for c in consumers] == ["holding"]


async def test_wifi_drop_at_212_then_stop_at_260(backend: Backend) -> None:
    """The design seed: reconnect at another edge with Last-Event-ID 212, Stop at 260."""
    replica, edge_a, edge_b, r = backend.log(), backend.log(), backend.log(), rid()
    await edge_a.create(r)
    stop_seen = asyncio.Event()

    async def watch_stops() -> None:
        async with aclosing(replica.watch_stops()) as stops:
            async for reply_id in stops:
                if reply_id == r:
                    stop_seen.set()
                    return

    async def generate() -> None:
        n = 0
        while not stop_seen.is_set():
            n += 1
            await replica.append(r, TokenEvent(n, f"w{n} ", [n]))
            await asyncio.sleep(0.001 if n < 255 else 0.01)  # slow near the end so Stop lands mid-reply
        await replica.finish(r, final(state=ReplyState.STOPPED, reason="abort", completion_tokens=n))

    watcher = asyncio.create_task(watch_stops())
    await asyncio.sleep(0.05)
    producer = asyncio.create_task(generate())

    first: list[int] = []
    async with aclosing(edge_a.subscribe(r)) as events:
        async for event in events:
            first.append(event.n)
            if event.n == 212:
                break  # Wi-Fi drops
    assert first == list(range(1, 213))

    second: list[Any] = []
    async with aclosing(edge_b.subscribe(r, after=212)) as events:
        async for event in events:
            second.append(event)
            if event.n == 260:
                assert await edge_b.request_stop(r) is True
    await asyncio.wait_for(asyncio.gather(producer, watcher), 10)

    end = second[-1]
    assert isinstance(end, FinalEvent) and end.state is ReplyState.STOPPED and end.finish_reason == "abort"
    assert [e.n for e in second] == list(range(213, end.n + 1))  # no gap, no repeat
    assert end.completion_tokens == end.n - 1 >= 260  # the text up to Stop is kept
    assert len(await replica.read(r)) == end.n


# -- Redis only ----------------------------------------------------------------------------


async def test_redis_listener_of_a_dead_gateway_ages_out(redis_backend: Backend) -> None:
    backend = redis_backend
    # heartbeat far slower than the stale limit: as if the gateway process froze or died
    edge, replica, r = backend.log(heartbeat_s=30, listener_stale_s=0.3), backend.log(), rid()
    await edge.create(r)
    events = edge.subscribe(r)
    task = asyncio.create_task(anext(events))
    await asyncio.sleep(0.05)
    assert await replica.listener_count(r) == 1
    await asyncio.sleep(0.4)
    assert await replica.listener_count(r) == 0
    idle = await replica.listener_idle_s(r)
    assert idle is not None and idle >= 0.3
    task.cancel()  # throws into the generator, which leaves (and closes) on its own
    with pytest.raises(asyncio.CancelledError):
        await task
    await events.aclose()


def test_a_tokens_append_part_packed_by_hand_is_the_generic_one() -> None:
    """The replica's per-token part of an append call, packed by hand for speed, is byte for byte
    what the generic packing of an event's part makes (which final events still use)."""
    log = make_relay(REDIS_URL, prefix="t:").log
    for event in (TokenEvent(5, "héllo \x1f\n\"", [1, 2]), TokenEvent(1, "", []), TokenEvent(300, "x" * 5000, [7])):
        for run in (None, 0, 3):
            assert log._token_part("rep_1", event, run) == log._event_part("rep_1", event, run)


async def test_redis_listener_that_saw_the_end_is_not_refreshed(redis_backend: Backend) -> None:
    """A listener is counted in its first read's round trip; one that got the final event stops
    heartbeating (no leave round trip: nobody counts a finished reply's listeners) and ages out,
    while one that leaves a running reply is uncounted at once."""
    edge, replica = redis_backend.log(heartbeat_s=0.05, listener_stale_s=0.3), redis_backend.log()
    done, running = rid(), rid()
    for r in (done, running):
        await replica.create(r)
        await replica.append(r, TokenEvent(0, "a"))
    await replica.finish(done, final())
    assert [e.n for e in await collect(edge, done)] == [1, 2]
    assert await replica.listener_count(done) == 1  # not left...
    await asyncio.sleep(0.6)
    assert await replica.listener_count(done) == 0  # ...and no longer refreshed, though heartbeats run
    events = edge.subscribe(running)
    assert (await anext(events)).n == 1
    assert await replica.listener_count(running) == 1
    await events.aclose()
    assert await replica.listener_count(running) == 0


async def test_redis_live_gap_is_filled_from_the_log(redis_backend: Backend) -> None:
    """An event that is logged but never heard live (its message lost) still reaches the subscriber."""
    import redis.asyncio as aioredis

    gateway, replica, r = redis_backend.log(), redis_backend.log(), rid()
    await replica.create(r)
    listener = asyncio.create_task(collect(gateway, r))
    await asyncio.sleep(0.1)
    await produce(replica, r, 2)
    raw = aioredis.from_url(REDIS_URL, decode_responses=True)
    await raw.xadd(f"{redis_backend.prefix}reply:{{{r}}}", {"k": "t", "n": "3", "text": "t3 ", "ids": "3"}, id="3-0")
    await raw.aclose()
    await produce(replica, r, 2, start=4)
    await replica.finish(r, final())
    events = await asyncio.wait_for(listener, 5)
    assert [e.n for e in events] == [1, 2, 3, 4, 5, 6] and events[2].text == "t3 "


async def test_redis_unsubscriptions_wait_to_share_a_write_and_none_is_left_behind(redis_backend: Backend) -> None:
    """Subscribers that left are unsubscribed with the next subscription's write, or within
    UNSUBSCRIBE_WAIT_S: no channel stays subscribed on Redis. A reply followed again before its
    unsubscription went out still hears its events."""
    import redis.asyncio as aioredis

    from fairway.relay.redis_live import UNSUBSCRIBE_WAIT_S

    gateway, replica, ids = redis_backend.log(), redis_backend.log(), [rid() for _ in range(3)]
    raw = aioredis.from_url(REDIS_URL, decode_responses=True)

    async def subscribed() -> list[int]:
        channels = [f"{redis_backend.prefix}reply:{{{r}}}:live" for r in ids]
        counts = await raw.execute_command("PUBSUB", "SHARDNUMSUB", *channels)
        return [int(c) for c in counts[1::2]]

    try:
        for r in ids:
            await replica.create(r)
            await replica.append(r, TokenEvent(1, "a"))
            async with aclosing(gateway.subscribe(r)) as events:
                assert (await anext(events)).n == 1
        # Each left before the next subscribed: its unsubscription went with that subscription, the
        # last one's still waits.
        assert await subscribed() == [0, 0, 1]
        async with aclosing(gateway.subscribe(ids[2])) as events:  # again, before it went out
            assert (await anext(events)).n == 1
            assert await subscribed() == [0, 0, 1]
            await replica.append(ids[2], TokenEvent(2, "b"))
            assert (await asyncio.wait_for(anext(events), 5)).n == 2
        assert await subscribed() == [0, 0, 1]
        await asyncio.sleep(UNSUBSCRIBE_WAIT_S + 0.2)
        assert await subscribed() == [0, 0, 0]
    finally:
        await raw.aclose()


async def test_replica_appends_of_one_step_share_a_round_trip() -> None:
    from fairway.replica.worker import _Appender

    log = InProcessTokenLog()
    calls: list[int] = []
    append_many = log.append_many

    async def counting(items: Any, runs: Any = None) -> list[int | Exception]:
        calls.append(len(items))
        return await append_many(items, runs)

    log.append_many = counting  # type: ignore[method-assign]
    appender = _Appender(log)
    await log.append("dup", TokenEvent(1, "first"))
    results = await asyncio.gather(*(appender.append(f"r{i}", TokenEvent(1, "x")) for i in range(5)),
                                   appender.append("dup", TokenEvent(1, "again")), return_exceptions=True)
    assert calls[-1] == 6  # one engine step, one call
    assert results[:5] == [1] * 5 and isinstance(results[5], EventOutOfOrder)
    # The next step's appends share the next call.
    assert await asyncio.gather(appender.append("r0", TokenEvent(2, "y")), appender.append("r1", TokenEvent(2, "z"))) \
        == [2, 2]
    assert calls[-1] == 2 and [e.text for e in await log.read("r1")] == ["x", "z"]


async def test_redis_unreachable_raises_relay_unavailable() -> None:
    relay = make_relay("redis://127.0.0.1:1/0", connect_timeout_s=0.5)
    log = relay.log
    start = time.monotonic()
    for call in (log.read("r1"), log.append("r1", TokenEvent(0, "x")), collect(log, "r1"), relay.jobs.claim(),
                 relay.inbox.post("box", {"n": 1}), relay.launch("r2", {}), relay.ping()):
        with pytest.raises(RelayUnavailable):
            await call
    assert time.monotonic() - start < 10
    await relay.close()
