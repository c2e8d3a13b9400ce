"""The reply recorder: replicas' reports claimed in batches, written to the store, accounted once.

In process (the embedded backends: the in-process bus and limits, SQLite): what the recorder and
accounting do with a batch does not depend on the backends, whose batch calls have tests of their
own (test_conversation_store, test_relay)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fairway.conversation import MessageStatus, ReplyState, Role, make_store
from fairway.conversation.entities import Conversation, new_id, now
from fairway.conversation.recorder import ReplyRecorder
from fairway.conversation.store import ConversationStore, NewTurn
from fairway.limits import LimitsConfig, make_limits
from fairway.limits.quota import Reservation
from fairway.relay import InProcessTokenLog
from fairway.replica.report import REPORTS_QUEUE, ReplyReport
from fairway.usage.accounting import Accounting, reservation_meta
from fairway.usage.pricing import Pricing


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
    bus = InProcessTokenLog()
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
        await bus.submit(report, queue=REPORTS_QUEUE)
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
