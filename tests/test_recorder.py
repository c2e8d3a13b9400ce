"""The reply recorder: replicas' reports taken in batches, written to the store, accounted once,
and never lost: a batch is acknowledged only once recorded.

Mostly in process (the embedded backends: the in-process inbox and limits, SQLite): what the
recorder and accounting do with a batch does not depend on the backends, whose batch calls have
tests of their own (test_conversation_store, test_relay). The gateway killed while holding a
report runs on Redis, with a real process killed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from backends import missing
from redis_keys import delete_prefixed

from fairway.conversation import MessageStatus, ReplyState, Role, make_store
from fairway.conversation.entities import Conversation, new_id, now
from fairway.conversation.launched import LaunchedReplies
from fairway.conversation.recorder import ReplyRecorder
from fairway.conversation.recorder import log as recorder_log
from fairway.conversation.store import ConversationStore, Ending, NewTurn
from fairway.limits import LimitsConfig, make_limits
from fairway.limits.quota import Reservation
from fairway.relay import InProcessInbox, RelayUnavailable, make_relay
from fairway.replica.report import REPORTS_INBOX, ReplyReport
from fairway.usage.accounting import Accounting, reservation_meta
from fairway.usage.pricing import Pricing

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ConversationStore]:
    s = make_store(f"sqlite:///{tmp_path}/recorder.db")
    await s.init()
    yield s
    await s.close()


async def _reply(store: ConversationStore, meta: dict) -> str:
    conv = Conversation(id=new_id("conv"), user_id="u1", tier="paid", model="m", created_at=now(),
                        updated_at=now())
    _, reply = await store.store_turn(NewTurn(conv, True, [(Role.USER, "hi")], job={"model": "m", "meta": meta}))
    return reply.id


def _finished(reply_id: str, tokens: int = 7) -> dict:
    return ReplyReport("finished", reply_id, "replica-1", text="hello", state="FINISHED", finish_reason="stop",
                       prompt_tokens=3, completion_tokens=tokens, last_event_id=tokens + 1, duration_s=0.5).to_dict()


async def test_a_batch_of_reports_is_recorded_and_accounted_once(store: ConversationStore) -> None:
    limits = make_limits(None, LimitsConfig())
    bus = InProcessInbox()
    reservations: dict[str, Reservation] = {}
    replies = []
    for _ in range(4):
        got = await limits.tokens.reserve("u1", "m", "paid", 100)
        assert isinstance(got, Reservation)
        reply_id = await _reply(store, {"user": "u1", "tier": "paid", "quota": reservation_meta(got)})
        reservations[reply_id] = got
        replies.append(reply_id)
    before = (await limits.tokens.state("u1", "m", "paid")).used
    assert before == 400
    a, b, c, d = replies
    # One batch: started reports, finished ones (one delivered twice, one whose started report
    # comes in the same batch after it), a report that is not one, and a reply with no job meta.
    reports = [ReplyReport("started", a, "replica-1").to_dict(), ReplyReport("started", b, "replica-1").to_dict(),
               _finished(b), _finished(c), _finished(c), {"kind": "nonsense"}, _finished(d),
               ReplyReport("started", d, "replica-2").to_dict()]
    for report in reports:
        await bus.post(REPORTS_INBOX, report)
    recorder = ReplyRecorder(store, bus, batch_max=64, linger_s=0.05)
    batches: list[list[str]] = []

    async def seen(finished: list[ReplyReport]) -> None:
        batches.append([r.reply_id for r in finished])

    recorder.on_finished += [Accounting(store, limits, Pricing()).on_finished, seen]
    task = asyncio.create_task(recorder.run())
    try:
        for _ in range(100):
            await asyncio.sleep(0.02)
            if batches:
                break
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert batches == [[b, c, c, d]]  # all in one batch
    assert (await store.get_reply(a)).state is ReplyState.RUNNING
    for reply_id in (b, c, d):
        reply = await store.get_reply(reply_id)
        assert reply.state is ReplyState.FINISHED  # a late "started" report does not undo that
        message = next(m for m in await store.list_messages(reply.conversation_id) if m.reply_id == reply_id)
        assert (message.text, message.status) == ("hello", MessageStatus.COMPLETE)
        usage = await store.get_usage(reply_id)
        assert (usage.user_id, usage.completion_tokens, usage.cost > 0) == ("u1", 7, True)
    assert await store.get_usage(a) is None
    # Three replies settled to their 10 tokens each (c once), a's reservation still held.
    assert (await limits.tokens.state("u1", "m", "paid")).used == 100 + 3 * 10


async def test_replies_launched_here_are_remembered_within_a_bound(store: ConversationStore) -> None:
    """What the process that launched a reply knows of it: its stored job, and whether its relay
    saved it; the oldest go first past the bound, and what is not remembered is read from the store."""
    launched = LaunchedReplies(max_entries=2)
    ids = [await _reply(store, {"user": "u1", "n": i}) for i in range(3)]
    for i, reply_id in enumerate(ids):
        launched.add(reply_id, {"model": "m", "meta": {"user": "u1", "n": i, "from": "memory"}})
    assert [reply_id in launched for reply_id in ids] == [False, True, True]
    jobs = await launched.jobs(store, ids)
    assert [jobs[i]["meta"] for i in ids] == [{"user": "u1", "n": 0}, {"user": "u1", "n": 1, "from": "memory"},
                                              {"user": "u1", "n": 2, "from": "memory"}]
    launched.mark_saved(ids[2])
    launched.mark_saved(ids[0])  # (not remembered: nothing to mark)
    assert [launched.saved(i) for i in ids] == [False, False, True]
    launched.forget([ids[2]])
    assert ids[2] not in launched and not launched.saved(ids[2]) and len(launched) == 1


async def test_the_recorder_skips_only_the_writes_of_replies_its_relay_saved(store: ConversationStore) -> None:
    """A reply this process's relay saved: its reports change nothing in the store, so the
    recorder sends none of their writes, and accounts it from the job it remembers. One launched
    here but not saved yet (its client left): saved by the recorder, as any other."""
    limits = make_limits(None, LimitsConfig())
    bus = InProcessInbox()
    launched = LaunchedReplies()
    meta = {"user": "u1", "tier": "paid"}
    relayed, unwatched = await _reply(store, meta), await _reply(store, meta)
    for reply_id in (relayed, unwatched):
        launched.add(reply_id, {"model": "m", "meta": meta})
    await store.finish_reply(relayed, "hello", MessageStatus.COMPLETE, "stop", completion_tokens=7,
                             look_up_existing=False)
    launched.mark_saved(relayed)
    writes: list[str] = []
    real_finish, real_mark, real_jobs = store.finish_replies, store.mark_running_many, store.get_reply_jobs

    async def finish_replies(endings: list[Ending]) -> None:
        writes.extend(f"finish {e.reply_id}" for e in endings)
        await real_finish(endings)

    async def mark_running_many(started: list[tuple[str, str]]) -> int:
        writes.extend(f"start {reply_id}" for reply_id, _ in started)
        return await real_mark(started)

    async def get_reply_jobs(ids: list[str]) -> dict:
        writes.extend(f"read {reply_id}" for reply_id in ids)
        return await real_jobs(ids)

    store.finish_replies, store.mark_running_many = finish_replies, mark_running_many  # type: ignore[method-assign]
    store.get_reply_jobs = get_reply_jobs  # type: ignore[method-assign]
    for reply_id in (relayed, unwatched):
        await bus.post(REPORTS_INBOX, ReplyReport("started", reply_id, "replica-1").to_dict())
        await bus.post(REPORTS_INBOX, _finished(reply_id))
    recorder = ReplyRecorder(store, bus, linger_s=0.05, launched=launched)
    recorder.on_finished.append(Accounting(store, limits, Pricing(), launched).on_finished)

    async def both_accounted() -> bool:
        return all([await store.get_usage(relayed), await store.get_usage(unwatched)])

    await _run_until(recorder, both_accounted)
    assert sorted(writes) == [f"finish {unwatched}", f"start {unwatched}"]
    for reply_id in (relayed, unwatched):
        reply = await store.get_reply(reply_id)
        assert reply.state is ReplyState.FINISHED
        assert [m.text for m in await store.list_messages(reply.conversation_id) if m.reply_id == reply_id] == ["hello"]
    await asyncio.sleep(0.05)  # (forgotten once the batch is recorded)
    assert relayed not in launched and unwatched not in launched


async def test_a_recorded_batch_is_acknowledged_by_the_next_look_or_when_the_recorder_stops(
        store: ConversationStore) -> None:
    """The acknowledgement of a batch rides on the recorder's next look at the inbox (the next
    batch's, or its look for reclaimable reports, reclaim_every_s at most): nothing it recorded
    stays pending for long while it runs, nor after it is stopped, so no other gateway takes
    those reports again."""
    bus = InProcessInbox()
    first, second = await _reply(store, {}), await _reply(store, {})
    await bus.post(REPORTS_INBOX, _finished(first))
    recorder = ReplyRecorder(store, bus, linger_s=0.05, reclaim_every_s=0.1)
    task = asyncio.create_task(recorder.run())
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if (await store.get_reply(first)).state is ReplyState.FINISHED:
                break
        await asyncio.sleep(0.3)  # (its next look for reclaimable reports acknowledges it)
        assert await bus.reclaim(REPORTS_INBOX, "check", min_idle_s=0, max_count=10) == []
        await bus.post(REPORTS_INBOX, _finished(second))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if (await store.get_reply(second)).state is ReplyState.FINISHED:
                break
    finally:
        task.cancel()  # (the batch is recorded, not yet acknowledged)
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert (await store.get_reply(second)).state is ReplyState.FINISHED
    assert await bus.reclaim(REPORTS_INBOX, "check", min_idle_s=0, max_count=10) == []


async def _run_until(recorder: ReplyRecorder, done: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    task = asyncio.create_task(recorder.run())
    try:
        deadline = time.monotonic() + timeout
        while not await done():
            assert time.monotonic() < deadline, "the recorder did not get there"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_batch_the_store_refused_is_recorded_when_taken_again(store: ConversationStore) -> None:
    """The database away for a moment loses nothing: the batch is not acknowledged, comes back
    retry_after_s later, and is recorded one report at a time; a report the store keeps refusing
    is dropped after max_attempts, without holding up the others."""
    bus = InProcessInbox()
    good, poison = await _reply(store, {}), await _reply(store, {})
    real = store.finish_replies
    calls: list[list[str]] = []

    async def flaky(endings: list[Ending]) -> None:
        calls.append([e.reply_id for e in endings])
        if len(calls) == 1:
            raise ConnectionError("the database went away")
        if any(e.reply_id == poison for e in endings):
            raise ValueError("the store refuses this one")
        await real(endings)

    store.finish_replies = flaky  # type: ignore[method-assign]
    for reply_id in (good, poison):
        await bus.post(REPORTS_INBOX, _finished(reply_id))
    recorder = ReplyRecorder(store, bus, linger_s=0.05, retry_after_s=0.2, reclaim_every_s=0.05, max_attempts=3)

    async def poison_given_up() -> bool:
        return len(calls) >= 4

    await _run_until(recorder, poison_given_up)
    await asyncio.sleep(0.1)  # (its acknowledgement follows the failed call)
    assert calls[0] == [good, poison]  # one batch, refused
    assert sorted(calls[1:]) == sorted([[good], [poison], [poison]])  # then alone: good once, poison until attempt 3
    assert (await store.get_reply(good)).state is ReplyState.FINISHED
    assert (await store.get_reply(poison)).state is not ReplyState.FINISHED
    assert await bus.reclaim(REPORTS_INBOX, "check", min_idle_s=0, max_count=10) == []  # nothing left pending


async def test_reports_a_killed_gateway_had_taken_are_recorded_by_another(store: ConversationStore) -> None:
    """On Redis: a gateway process takes a reply's "finished" report and is killed (SIGKILL)
    before recording it. Another gateway's recorder takes it again and saves the reply and its
    usage, once."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    relay = make_relay(REDIS_URL, prefix=prefix)
    inbox = relay.inbox
    try:
        await relay.ping()
    except RelayUnavailable:
        await relay.close()
        missing("Redis", f"nothing answers at {REDIS_URL}")
    try:
        reply_id = await _reply(store, {"user": "u1", "tier": "paid"})
        await inbox.post(REPORTS_INBOX, _finished(reply_id))
        dying = textwrap.dedent(f"""
            import asyncio, os, signal
            from fairway.relay import make_relay

            async def main():
                inbox = make_relay({REDIS_URL!r}, prefix={prefix!r}).inbox
                taken = await inbox.take({REPORTS_INBOX!r}, "dying-gateway", max_count=64, timeout=10)
                print(len(taken), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # before recording or acknowledging anything

            asyncio.run(main())
        """)
        proc = subprocess.run([sys.executable, "-c", dying], capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stdout.strip()) == (-signal.SIGKILL, "1"), proc.stderr
        assert await inbox.take(REPORTS_INBOX, "survivor", max_count=64) == []  # taken is taken

        recorder = ReplyRecorder(store, inbox, retry_after_s=0.5, reclaim_every_s=0.1)
        recorder.on_finished.append(Accounting(store, make_limits(None, LimitsConfig()), Pricing()).on_finished)

        async def usage_stored() -> bool:
            return await store.get_usage(reply_id) is not None

        await _run_until(recorder, usage_stored)
        reply = await store.get_reply(reply_id)
        assert reply.state is ReplyState.FINISHED
        messages = [m for m in await store.list_messages(reply.conversation_id) if m.reply_id == reply_id]
        assert [(m.text, m.status) for m in messages] == [("hello", MessageStatus.COMPLETE)]
        assert await inbox.reclaim(REPORTS_INBOX, "check", min_idle_s=0, max_count=10) == []  # acknowledged
    finally:
        await delete_prefixed(REDIS_URL, prefix)
        await relay.close()


async def test_the_recorder_carries_on_when_redis_lost_its_inbox(store: ConversationStore,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Redis restarted without its data (this deployment keeps none on disk): the inbox's stream
    and group are gone under a running recorder, which makes them again and records what comes,
    without an error."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    relay = make_relay(REDIS_URL, prefix=prefix, block_s=0.2)
    inbox = relay.inbox
    try:
        await relay.ping()
    except RelayUnavailable:
        await relay.close()
        missing("Redis", f"nothing answers at {REDIS_URL}")
    recorder = ReplyRecorder(store, inbox, linger_s=0.01)
    task = asyncio.create_task(recorder.run())
    try:
        for _ in range(2):
            reply_id = await _reply(store, {})
            await inbox.post(REPORTS_INBOX, _finished(reply_id))
            deadline = time.monotonic() + 20
            while (await store.get_reply(reply_id)).state is not ReplyState.FINISHED:
                assert time.monotonic() < deadline, "the report was not recorded"
                await asyncio.sleep(0.02)
            await delete_prefixed(REDIS_URL, prefix)  # the stream and its group, gone
            await asyncio.sleep(0.3)  # (the recorder's blocking read runs into the missing group)
        # (the recorder's own: other tests' servers in this process log too)
        mine = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == recorder_log.name]
        assert not mine, caplog.text
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await delete_prefixed(REDIS_URL, prefix)
        await relay.close()


async def test_a_finished_report_gets_through_a_redis_restart(store: ConversationStore) -> None:
    """The replica retries a "finished" report while the inbox is unreachable (Redis restarting),
    and the recorder then saves the reply; a report that never gets through is said so (False)."""
    from fairway.replica.worker import post_report

    class Restarting(InProcessInbox):
        down_for = 2  # posts refused before it is back

        async def post(self, inbox: str, item: dict) -> None:
            if self.down_for:
                self.down_for -= 1
                raise RelayUnavailable("Redis unreachable: connection refused")
            await super().post(inbox, item)

    bus = Restarting()
    reply_id = await _reply(store, {})
    report = ReplyReport.from_dict(_finished(reply_id))
    assert await post_report(bus.post, report, delays=(0.01, 0.01, 0.01))
    await _run_until(ReplyRecorder(store, bus), lambda: _finished_in(store, reply_id))
    bus.down_for = 10
    assert not await post_report(bus.post, report, delays=(0.01,))


async def _finished_in(store: ConversationStore, reply_id: str) -> bool:
    return (await store.get_reply(reply_id)).state is ReplyState.FINISHED
