"""A reply run again after its token log was lost never splices two runs into one message.

A gateway that read the reply's row (restarts = k) and only then subscribed to its log must not
take the next run's log, made under the same reply id meanwhile by another gateway's restart, for
run k's; nor may a subscriber already attached when the log went take the new run's events as the
continuation of the old one. Either way the client is told to start over (a snapshot that empties
its text) and gets the new run from its start, with the new run's ids (gateway/cursor.py).

Run on the real relay backends (in process, Redis, a Redis Cluster) and a real SQLite store; the
restart is ConversationService.restart, as a gateway's reader or sweep runs it."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import pytest
from backends import missing
from redis_keys import delete_prefixed

from fairway.conversation import Reply, Role
from fairway.conversation.entities import Conversation, new_id, now
from fairway.conversation.service import ConversationService
from fairway.conversation.sql_store import SqlConversationStore
from fairway.conversation.store import NewTurn
from fairway.gateway.cursor import RUN_SPAN
from fairway.gateway.streaming import ReplyRelay, Snapshot
from fairway.relay import (
    FinalEvent,
    Relay,
    RelayUnavailable,
    ReplyNotFound,
    ReplyState,
    RunReplaced,
    TokenEvent,
    make_relay,
)
from fairway.replica.job import replica_queue
from fairway.replica.registry import InProcessRegistry, ReplicaInfo
from fairway.router import Router

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
OLD = [f"a{i} " for i in range(1, 6)]  # the lost run's text, event by event
NEW = [f"b{i} " for i in range(1, 7)]  # the new run's: a different text (a sampled reply)


@dataclass
class World:
    kind: str
    relay: Relay
    store: SqlConversationStore
    service: ConversationService
    gateway: ReplyRelay
    prefix: str

    async def lose_log(self, reply_id: str) -> None:
        """What a Redis restarted without persistence (or the process holding an in-process log)
        does to a reply's log: it is gone."""
        if self.kind == "memory":
            self.relay.log._logs.pop(reply_id)  # type: ignore[attr-defined]
            return
        stream = f"{self.prefix}reply:{{{reply_id}}}"
        await self.relay.client.execute("DEL", stream, *(f"{stream}:{part}" for part in ("listened", "run")))  # type: ignore[attr-defined]


async def opened(kind: str, request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[World]:
    url = {"memory": None, "redis": REDIS_URL}.get(kind, "cluster")
    if url == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    relay = make_relay(url, prefix=prefix, block_s=0.2)
    try:
        await relay.ping()
    except RelayUnavailable:
        await relay.close()
        missing("Redis", f"nothing answers at {url}")
    store = SqlConversationStore(f"sqlite+aiosqlite:///{tmp_path}/fairway.db")
    await store.init()
    registry = InProcessRegistry(ttl_s=60)
    await registry.announce(ReplicaInfo("a", "smollm2", replica_queue("a"), 1024, 1000))
    service = ConversationService(store, relay, Router(registry, cache_s=0), {})
    yield World(kind, relay, store, service, ReplyRelay(relay.log, store, service, keepalive_s=60), prefix)
    await relay.close()
    await store.close()
    if kind == "redis":
        await delete_prefixed(REDIS_URL, prefix)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def world(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[World]:
    async for w in opened(request.param, request, tmp_path):
        yield w


@pytest.fixture(params=["redis", "cluster"])
async def redis_world(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[World]:
    async for w in opened(request.param, request, tmp_path):
        yield w


async def started_reply(w: World) -> Reply:
    """A reply whose first run logged OLD and is still going."""
    ts = now()
    conversation = Conversation(new_id("conv"), "u1", "paid", "smollm2", "t", ts, ts)
    _, reply = await w.store.store_turn(NewTurn(conversation, True, [(Role.USER, "hi")], uuid.uuid4().hex,
                                                [1, 2, 3], "a", {"model": "smollm2"}))
    assert reply is not None
    await w.relay.log.create(reply.id)
    for text in OLD:
        await w.relay.log.append(reply.id, TokenEvent(0, text, [1]))
    return reply


async def run_again(w: World, reply: Reply) -> None:
    """Another gateway finds the log lost and runs the reply again; its new run logs NEW and ends."""
    await w.lose_log(reply.id)
    assert await w.service.restart(reply)
    for text in NEW:
        await w.relay.log.append(reply.id, TokenEvent(0, text, [2]))
    await w.relay.log.finish(reply.id, FinalEvent(0, "stop", ReplyState.FINISHED))


async def streamed(w: World, reply: Reply, after: int) -> list:
    """What a client that holds event `after` is sent, to the reply's end."""
    items: list = []
    async with aclosing(w.gateway.event_batches(reply, after)) as batches:
        async for batch in batches:
            items += batch
    return items


def text_of(items: list) -> str:
    """The client's text as a chat client builds it: a snapshot replaces what it had."""
    text = ""
    for item in items:
        if isinstance(item, Snapshot):
            text = item.event.text
        elif isinstance(item, TokenEvent):
            text += item.text
    return text


def check_new_run_from_its_start(items: list) -> None:
    snapshot = [i for i in items if isinstance(i, Snapshot)]
    assert len(snapshot) == 1 and snapshot[0].event.n == RUN_SPAN, items
    after = items[items.index(snapshot[0]) + 1:]
    assert [i.n for i in after] == [RUN_SPAN + n for n in range(1, len(NEW) + 2)], items
    assert isinstance(after[-1], FinalEvent)


async def test_a_gateway_that_read_the_row_before_another_ran_the_reply_again_never_splices_the_runs(
        world: World) -> None:
    """The gateway read restarts = 0; before it subscribes, the log is lost and another gateway
    runs the reply again under the same id. The client held event 3 of the lost run."""
    reply = await started_reply(world)
    row = await world.store.get_reply(reply.id)  # what the resuming gateway read
    assert row is not None and row.restarts == 0
    await run_again(world, row)  # between its read and its subscription
    items = await streamed(world, row, 3)
    assert text_of(items) == "".join(NEW), items  # not OLD[:3] + NEW[3:]
    check_new_run_from_its_start(items)


async def test_a_subscriber_attached_when_its_log_is_lost_and_made_again_starts_over(world: World) -> None:
    """A client streaming the first run (from event 2) when the log goes and a restart makes the
    next run's log under the same key: its stream does not carry on into the new run's events as
    if they were the old run's."""
    reply = await started_reply(world)
    items: list = []
    async with aclosing(world.gateway.event_batches(reply, 2)) as batches:
        async for batch in batches:
            items += batch
            if batch and isinstance(batch[-1], TokenEvent) and batch[-1].n == len(OLD):  # the first run's events so far: now it is lost
                await run_again(world, reply)
    assert [i.n for i in items[:3]] == [3, 4, 5]  # the first run's, as they came
    assert text_of(items) == "".join(NEW), items
    check_new_run_from_its_start(items[3:])


async def test_a_reader_of_one_run_is_told_the_log_holds_another(world: World) -> None:
    """The token log's own contract: a read or a subscription for run k of a log made for run
    k + 1 raises ReplyNotFound (run k's log is gone), at once and atomically with what it reads."""
    log = world.relay.log
    reply_id = f"r{uuid.uuid4().hex[:8]}"
    assert await log.create(reply_id, run=2)
    await log.append(reply_id, TokenEvent(0, "x", [1]))
    assert [e.n for e in await log.read(reply_id, 0, run=2)] == [1]
    assert [e.n for e in await log.read(reply_id, 0)] == [1]  # a reader of any run (the replica's)
    # A row that counts a run more than any log was made for (two gateways' restarts raced: the
    # second claimed just before the first made its log, then found it): this log is its run.
    assert [e.n for e in await log.read(reply_id, 0, run=3)] == [1]
    with pytest.raises(ReplyNotFound):
        await log.read(reply_id, 0, run=1)
    with pytest.raises(ReplyNotFound):
        async with aclosing(log.subscribe_batches(reply_id, 0, run=1)) as batches:
            async for _ in batches:
                pass


async def test_a_replica_of_the_previous_version_appending_to_a_later_runs_log_still_reaches_its_readers(
        redis_world: World) -> None:
    """A rolling upgrade: a replica still on the previous version appends to a run-1 log with its
    own script, which publishes the log's own n (not 1 * RUN_SPAN + n) and knows no run key. A
    subscriber of run 1 cannot take that event from the live channel as its own, asks the log
    (which still says run 1) and goes on; the new version's final event ends it."""
    log, client = redis_world.relay.log, redis_world.relay.client  # type: ignore[attr-defined]
    reply_id = f"r{uuid.uuid4().hex[:8]}"
    stream = f"{redis_world.prefix}reply:{{{reply_id}}}"
    assert await log.create(reply_id, run=1)
    await log.append(reply_id, TokenEvent(0, "new", [6]))
    seen: list = []
    async with aclosing(log.subscribe_batches(reply_id, 0, run=1)) as batches:
        async for batch in batches:
            seen += batch
            if not seen:
                continue
            if len(seen) == 1:  # what the previous version's append script did for event 2
                await client.execute("XADD", stream, "2-0", "k", "t", "text", "old", "ids", "7", "n", "2")
                await client.execute("SPUBLISH", f"{stream}:live", "2 t7\x1fold")
                await log.finish(reply_id, FinalEvent(0, "stop", ReplyState.FINISHED))
    assert [(e.n, getattr(e, "text", None)) for e in seen] == [(1, "new"), (2, "old"), (3, None)]


async def test_a_row_that_counts_a_run_its_log_was_never_made_for_streams_the_log_there(world: World) -> None:
    """Two gateways run a lost reply again at once: the second claims its run (restarts 2) just
    after the first claimed run 1 and before it made run 1's log, then finds that log and gives up.
    The row says 2, the one log is run 1's: readers of run 2 stream it (it is the reply's only
    run since the loss) rather than ending with an error."""
    reply = await started_reply(world)
    await world.lose_log(reply.id)
    store = world.store
    claim = store.claim_restart

    async def and_another_right_after(id: str, restarts: int, replica_id: str) -> Reply | None:
        claimed = await claim(id, restarts, replica_id)
        store.claim_restart = claim  # type: ignore[method-assign]
        assert await claim(id, restarts + 1, "b") is not None  # the second gateway's claim
        return claimed

    store.claim_restart = and_another_right_after  # type: ignore[method-assign]
    assert await world.service.restart(reply)
    assert not await world.relay.log.create(reply.id, run=2)  # the second gateway's create: the log is there
    for text in NEW:
        await world.relay.log.append(reply.id, TokenEvent(0, text, [2]))
    await world.relay.log.finish(reply.id, FinalEvent(0, "stop", ReplyState.FINISHED))
    row = await store.get_reply(reply.id)
    assert row is not None and row.restarts == 2
    items = await streamed(world, row, 0)
    assert text_of(items) == "".join(NEW), items
    assert [i.n for i in items] == [2 * RUN_SPAN + n for n in range(1, len(NEW) + 2)]


async def test_a_producer_of_the_lost_run_cannot_write_into_the_next_runs_log(world: World) -> None:
    """The replica still running the first run never learnt its log was lost. The restart's job
    says run 1; once run 1 has logged as many events as run 0 had, run 0's producer's next n fits
    run 1's log, and so would its final event: both are refused for their run (RunReplaced, not an
    order error), and a client reading the reply gets run 1's text alone."""
    log = world.relay.log
    reply = await started_reply(world)  # run 0 logged OLD: its producer's next event is len(OLD) + 1
    await world.lose_log(reply.id)
    assert await world.service.restart(reply)
    (queued,) = await world.relay.jobs.unfinished(queue=replica_queue("a"))
    assert queued.job["run"] == 1  # what the new run's replica appends as
    for text in NEW[:len(OLD)]:
        await log.append(reply.id, TokenEvent(0, text, [2]), run=1)
    with pytest.raises(RunReplaced) as refused:
        await log.append(reply.id, TokenEvent(len(OLD) + 1, "a6 ", [1]), run=0)
    assert (refused.value.run, refused.value.held) == (0, 1)
    (result,) = await log.append_many([(reply.id, TokenEvent(len(OLD) + 1, "a6 ", [1]))], [0])
    assert isinstance(result, RunReplaced)
    with pytest.raises(RunReplaced):
        await log.finish(reply.id, FinalEvent(0, "stop", ReplyState.STOPPED), run=0)
    for text in NEW[len(OLD):]:
        await log.append(reply.id, TokenEvent(0, text, [2]), run=1)
    await log.finish(reply.id, FinalEvent(0, "stop", ReplyState.FINISHED), run=1)
    row = await world.store.get_reply(reply.id)
    assert row is not None and row.restarts == 1
    items = await streamed(world, row, 0)
    assert text_of(items) == "".join(NEW), items
    assert [i.n for i in items] == [RUN_SPAN + n for n in range(1, len(NEW) + 2)]


async def test_a_log_made_by_a_producers_append_holds_its_run(world: World) -> None:
    """A log no create() made (lost, and the producer's append came first) is of the appending
    producer's run: another run's producer is refused, and readers are told which run it holds;
    a producer that names no run (a replica's job from a gateway of the previous version) is not
    checked."""
    log = world.relay.log
    reply_id = f"r{uuid.uuid4().hex[:8]}"
    assert await log.append(reply_id, TokenEvent(1, "x", [1]), run=2) == 1
    with pytest.raises(RunReplaced):
        await log.append(reply_id, TokenEvent(2, "y", [1]), run=1)
    with pytest.raises(ReplyNotFound):  # a reader of run 1: its log is gone
        await log.read(reply_id, 0, run=1)
    assert await log.append(reply_id, TokenEvent(2, "y", [1])) == 2
    assert [e.text for e in await log.read(reply_id, 0, run=2)] == ["x", "y"]
    first = f"r{uuid.uuid4().hex[:8]}"
    assert await log.append(first, TokenEvent(1, "x", [1]), run=0) == 1  # run 0: the log of a first run
    with pytest.raises(RunReplaced):
        await log.append(first, TokenEvent(2, "y", [1]), run=1)
