"""The conversation store against both backends: a SQLite file and the real PostgreSQL.

PostgreSQL tests share one database per session (fairway_test_<random>, created through the
`postgres` maintenance database, dropped at the end), each test in its own fresh schema, so
tests never see each other's rows and none pays for a CREATE DATABASE.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from backends import missing
from pg_admin import PG_HOST, create_schema, pg_admin, temporary_database, terminate_lock_waiters
from sqlalchemy.exc import IntegrityError

from fairway.conversation import (
    ConversationBusy,
    ConversationStore,
    DuplicateClientKey,
    InvalidText,
    MessageStatus,
    NotFound,
    ReplyFinished,
    ReplyState,
    Role,
    StoreUnavailable,
    UsageRecord,
    database_url,
    make_store,
)
from fairway.conversation.entities import Attachment, Conversation, Message, Reply, new_id, now
from fairway.conversation.schema import conversations, metadata
from fairway.conversation.sql_store import SqlConversationStore, _values, alembic_config
from fairway.conversation.store import Ending, NewTurn

StoreFactory = Callable[[], SqlConversationStore]




@pytest.fixture(scope="session")
def pg_database() -> Iterator[str | None]:
    """The session's PostgreSQL database URL, or None when no server answers."""
    with temporary_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
async def open_store(request: pytest.FixtureRequest, tmp_path, pg_database: str | None) -> StoreFactory:
    """Opens (another) store on this test's database: SQLite file or PostgreSQL schema."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/fairway.db"
        return lambda: SqlConversationStore(url)
    settings = await _fresh_schema(pg_database)
    return lambda: SqlConversationStore(database_url(pg_database), connect_args=settings)


async def _fresh_schema(pg_database: str | None) -> dict[str, Any]:
    """A new schema in the session's PostgreSQL database: the connect_args that use it."""
    if pg_database is None:
        missing("PostgreSQL", f"nothing answers at {PG_HOST}")
    return {"server_settings": {"search_path": await create_schema(pg_database)}}


@pytest.fixture
async def store(open_store: StoreFactory) -> AsyncIterator[SqlConversationStore]:
    s = open_store()
    await s.init()
    yield s
    await s.close()


async def _turn(store: ConversationStore, user: str = "u1", text: str = "hi", conv: Conversation | None = None,
                **reply: Any) -> tuple[Conversation, Message, Reply]:
    """A user message and its queued reply: in a new conversation of user's, or the next turn of
    conv. reply: NewTurn's prompt_token_ids, replica_id, job."""
    conversation = conv or _new_conversation(user)
    msg, stored = await store.store_turn(NewTurn(conversation, conv is None, [(Role.USER, text)],
                                                 f"key-{uuid.uuid4().hex}", **reply))
    return conversation, msg, stored


async def test_conversation_crud_and_paging(store: ConversationStore) -> None:
    a = _new_conversation(tier="free", title="first")
    _, first = await store.store_turn(NewTurn(a, True, [(Role.USER, "hi")]))
    got = await store.get_conversation(a.id, "u1")
    assert got == a and got.title == "first" and got.tier == "free"
    await store.finish_reply(first.id, "hello", MessageStatus.COMPLETE)
    b, _, _ = await _turn(store)

    assert [c.id for c in await store.list_conversations("u1")] == [b.id, a.id]
    # A new message moves a conversation to the top.
    await _turn(store, conv=a, text="hello")
    page1 = await store.list_conversations("u1", limit=1)
    assert [c.id for c in page1] == [a.id]
    page2 = await store.list_conversations("u1", limit=1, before=page1[-1].updated_at)
    assert [c.id for c in page2] == [b.id]
    assert await store.list_conversations("u1", limit=1, before=page2[-1].updated_at) == []


async def test_other_users_conversation_is_invisible(store: ConversationStore) -> None:
    conv, _, _ = await _turn(store, user="alice")
    assert await store.get_conversation(conv.id, "mallory") is None
    assert await store.get_conversation("conv_missing", "alice") is None
    assert await store.list_conversations("mallory") == []
    assert await store.delete_conversation(conv.id, "mallory") is False
    assert await store.get_conversation(conv.id, "alice") is not None


async def test_messages_in_order_and_client_keys(store: ConversationStore) -> None:
    conv = _new_conversation()
    texts = [f"turn {i}" for i in range(5)]
    for i, text in enumerate(texts):
        _, reply = await store.store_turn(NewTurn(conv, i == 0, [(Role.USER, text)], f"m{i}"))
        await store.finish_reply(reply.id, f"answer {i}", MessageStatus.COMPLETE)
    listed = [m for m in await store.list_messages(conv.id) if m.role == Role.USER]
    assert [m.text for m in listed] == texts
    assert listed[3].status is MessageStatus.COMPLETE and listed[3].client_key == "m3"

    found = await store.get_message_by_client_key(conv.id, "m2")
    assert found is not None and found.text == "turn 2"
    assert await store.get_message_by_client_key(conv.id, "nope") is None

    with pytest.raises(DuplicateClientKey) as dup:
        await store.store_turn(NewTurn(conv, False, [(Role.USER, "resent")], "m2"))
    assert dup.value.existing.id == found.id
    assert len(await store.list_messages(conv.id)) == 10

    # Client keys are per conversation; messages without one never collide.
    other = _new_conversation()
    _, reply = await store.store_turn(NewTurn(other, True, [(Role.SYSTEM, "a"), (Role.USER, "same key elsewhere")],
                                              "m2"))
    await store.finish_reply(reply.id, "ok", MessageStatus.COMPLETE)
    await store.store_turn(NewTurn(other, False, [(Role.SYSTEM, "a"), (Role.SYSTEM, "b"), (Role.USER, "c")]))
    assert [m.text for m in await store.list_messages(other.id)] == ["a", "same key elsewhere", "ok", "a", "b", "c"]


def _new_conversation(user: str = "u1", id: str | None = None, tier: str = "paid", title: str = "a title") -> Conversation:
    ts = now()
    return Conversation(id or new_id("conv"), user, tier, "smollm2", title, ts, ts)


async def test_a_turn_is_stored_whole_or_not_at_all(store: ConversationStore) -> None:
    conv = _new_conversation()
    msg, reply = await store.store_turn(NewTurn(conv, True, [(Role.SYSTEM, "be brief"), (Role.USER, "hi")], "k1",
                                                [1, 2, 3], "replica-a", {"model": "smollm2"}))
    assert await store.get_conversation(conv.id, "u1") == conv
    listed = await store.list_messages(conv.id)
    assert [(m.role, m.text, m.client_key) for m in listed] == [(Role.SYSTEM, "be brief", None), (Role.USER, "hi", "k1")]
    assert listed[-1] == msg
    stored = await store.get_reply(reply.id)
    assert stored == reply and (stored.message_id, stored.state, stored.replica_id) == (msg.id, ReplyState.QUEUED,
                                                                                         "replica-a")
    assert stored.prompt_token_ids == [1, 2, 3] and stored.job == {"model": "smollm2"}

    # The next turn of the same conversation moves it to the top of the list.
    other = _new_conversation()
    await store.store_turn(NewTurn(other, True, [(Role.USER, "elsewhere")]))
    await store.finish_reply(reply.id, "hello", MessageStatus.COMPLETE)
    second, _ = await store.store_turn(NewTurn(conv, False, [(Role.USER, "again")], "k2"))
    assert [c.id for c in await store.list_conversations("u1")] == [conv.id, other.id]
    assert (await store.get_conversation(conv.id, "u1")).updated_at == second.created_at

    # The same message again (a resend racing the first): nothing new is stored.
    with pytest.raises(DuplicateClientKey) as dup:
        await store.store_turn(NewTurn(conv, False, [(Role.USER, "hi, resent")], "k1"))
    assert dup.value.existing.id == msg.id
    # A new conversation under a taken id (derived from the same client key): the first one's message.
    with pytest.raises(DuplicateClientKey) as dup:
        await store.store_turn(NewTurn(_new_conversation(id=conv.id), True, [(Role.USER, "hi")], "k1"))
    assert dup.value.existing.id == msg.id
    assert len(await store.list_messages(conv.id)) == 4
    assert len(await store.list_unfinished_replies()) == 2

    # The reply fails to store (here, a job that is not JSON): its conversation and message go too.
    doomed = _new_conversation()
    with pytest.raises(Exception, match="JSON serializable"):
        await store.store_turn(NewTurn(doomed, True, [(Role.USER, "hi")], "k9", job={"bad": object()}))
    assert await store.get_conversation(doomed.id, "u1") is None
    assert await store.list_messages(doomed.id) == []

    # A conversation deleted meanwhile: NotFound, and no stray message or reply.
    assert await store.delete_conversation(other.id, "u1")
    with pytest.raises(NotFound):
        await store.store_turn(NewTurn(other, False, [(Role.USER, "too late")]))
    assert await store.list_messages(other.id) == []
    assert len(await store.list_unfinished_replies()) == 1


async def test_of_gateways_racing_to_restart_a_reply_one_wins(store: ConversationStore) -> None:
    """A reply whose token log was lost runs again once per loss, however many readers find it
    gone at once: each claims the run it saw, and only the first claim of that run counts."""
    _, _, reply = await _turn(store)
    assert reply.restarts == 0
    # What a sweep for lost replies looks at: the unfinished ones stored before a time.
    assert reply.id in await store.unfinished_reply_ids(reply.created_at + 1)
    assert reply.id not in await store.unfinished_reply_ids(reply.created_at)
    claims = await asyncio.gather(*(store.claim_restart(reply.id, 0, f"replica-{i}") for i in range(4)))
    won = [c for c in claims if c is not None]
    assert len(won) == 1 and won[0].restarts == 1 and won[0].replica_id.startswith("replica-")
    assert (await store.get_reply(reply.id)).restarts == 1
    assert (await store.claim_restart(reply.id, 1, "replica-x")).restarts == 2  # lost again, run again
    await store.finish_reply(reply.id, "done", MessageStatus.COMPLETE)
    assert await store.claim_restart(reply.id, 2, "replica-y") is None  # an ended reply never runs again
    assert reply.id not in await store.unfinished_reply_ids(reply.created_at + 1)
    assert await store.claim_restart("rep_unknown", 0, "replica-y") is None


async def test_a_conversation_takes_no_new_turn_while_a_reply_to_it_runs(store: ConversationStore) -> None:
    conv, first, running = await _turn(store, text="first question")
    with pytest.raises(ConversationBusy) as busy:
        await _turn(store, conv=conv, text="second question")
    assert (busy.value.conversation_id, busy.value.reply_id) == (conv.id, running.id)
    assert [m.text for m in await store.list_messages(conv.id)] == ["first question"]
    # A resend of the running reply's own message is a duplicate, not a second turn.
    with pytest.raises(DuplicateClientKey) as dup:
        await store.store_turn(NewTurn(conv, False, [(Role.USER, "first question")], first.client_key))
    assert dup.value.existing.id == first.id
    # A flagged message starts no reply: it is kept (no context holds it) and claims nothing.
    flagged, none = await store.store_turn(NewTurn(conv, False, [(Role.USER, "bad words")], "k-flagged",
                                                   flagged=True, flagged_categories=["harassment"]))
    assert none is None and flagged.status is MessageStatus.FLAGGED

    # Once the reply has ended (any final state), the next turn is stored after its answer.
    await store.update_reply(running.id, state=ReplyState.RUNNING)
    await store.finish_reply(running.id, "first answer", MessageStatus.STOPPED, "stop")
    _, second, queued = await _turn(store, conv=conv, text="second question")
    assert [m.text for m in await store.list_messages(conv.id)] == [
        "first question", "bad words", "first answer", "second question"]
    # A shed reply is final at once; a resend of its message gets a reply of its own, which claims too.
    await store.finish_reply(queued.id, "second answer", MessageStatus.COMPLETE)
    _, third, shed = await _turn(store, conv=conv, text="third", shed=True)
    again = await store.add_reply(conv.id, third.id, [1], "r1", {})
    with pytest.raises(ConversationBusy) as busy:
        await store.add_reply(conv.id, third.id, [1], "r1", {})
    assert busy.value.reply_id == again.id
    with pytest.raises(NotFound):
        await store.add_reply("conv_gone", third.id, [1], "r1", {})
    with pytest.raises(NotFound):
        await _turn(store, conv=_new_conversation(id="conv_gone"))


async def test_of_turns_racing_into_one_conversation_one_is_stored(open_store: StoreFactory) -> None:
    """Eight turns at once, from two stores (two gateways' pools): one claims the conversation,
    the others are told it is busy, and nothing of theirs is stored."""
    stores = [open_store(), open_store()]
    for s in stores:
        await s.init()
    try:
        conv, _, first = await _turn(stores[0])
        await stores[0].finish_reply(first.id, "answer", MessageStatus.COMPLETE)
        for attempt in range(3):
            results = await asyncio.gather(*(_turn(stores[i % 2], conv=conv, text=f"racer {attempt}.{i}")
                                             for i in range(8)), return_exceptions=True)
            stored = [r for r in results if not isinstance(r, BaseException)]
            assert len(stored) == 1, results
            assert all(isinstance(r, ConversationBusy) and r.reply_id == stored[0][2].id
                       for r in results if isinstance(r, BaseException))
            await stores[1].finish_reply(stored[0][2].id, f"answer {attempt}", MessageStatus.COMPLETE)
        texts = [m.text for m in await stores[0].list_messages(conv.id)]
        assert len(texts) == 8 and texts[1::2] == ["answer", "answer 0", "answer 1", "answer 2"]
    finally:
        for s in stores:
            await s.close()


async def test_sqlite_writers_of_one_process_queue_instead_of_colliding(tmp_path) -> None:
    """SQLite takes one writer at a time. Writers of this process wait their turn in order; they
    never meet SQLite's busy handler (here made to fail at once, instead of its sleeps)."""
    store = SqlConversationStore(f"sqlite+aiosqlite:///{tmp_path}/fairway.db")
    await store.init()

    def fail_when_busy(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=0")
        cursor.close()

    sa.event.listen(store._engine.sync_engine, "connect", fail_when_busy)
    await store._engine.dispose()  # reconnect with it

    async def chat(i: int) -> None:
        message, reply = await store.store_turn(NewTurn(_new_conversation(), True, [(Role.USER, f"hi {i}")], f"k{i}"))
        await store.update_reply(reply.id, state=ReplyState.RUNNING, replica_id="r1")
        await store.finish_reply(reply.id, f"hello {i}", MessageStatus.COMPLETE, "stop")

    try:
        await asyncio.gather(*(chat(i) for i in range(30)))
        assert len(await store.list_conversations("u1", limit=100)) == 30
    finally:
        await store.close()


async def test_delete_cascades(store: ConversationStore) -> None:
    conv, _, done = await _turn(store)
    await store.finish_reply(done.id, "answer", MessageStatus.COMPLETE)
    _, _, live = await _turn(store, conv=conv, prompt_token_ids=[1, 2])
    keep, keep_msg, keep_reply = await _turn(store)

    assert await store.delete_conversation(conv.id, "u1") is True
    assert await store.get_conversation(conv.id, "u1") is None
    assert await store.list_messages(conv.id) == []
    assert await store.get_reply(done.id) is None and await store.get_reply(live.id) is None
    assert [r.id for r in await store.list_unfinished_replies()] == [keep_reply.id]
    assert await store.delete_conversation(conv.id, "u1") is False
    assert [m.id for m in await store.list_messages(keep.id)] == [keep_msg.id]


@pytest.mark.parametrize(
    ("status", "state", "reason"),
    [
        (MessageStatus.COMPLETE, ReplyState.FINISHED, "stop"),
        (MessageStatus.STOPPED, ReplyState.STOPPED, None),
        (MessageStatus.FLAGGED, ReplyState.FLAGGED, "content_filter"),
    ],
)
async def test_finish_reply_stores_assistant_message(
    store: ConversationStore, status: MessageStatus, state: ReplyState, reason: str | None
) -> None:
    conv, msg, reply = await _turn(store, prompt_token_ids=[5, 6, 7])
    await store.update_reply(reply.id, state=ReplyState.RUNNING, replica_id="r17", last_event_id=3)

    given_reason = "stop" if status is MessageStatus.COMPLETE else None  # flagged gets a default
    answer = await store.finish_reply(
        reply.id,
        "partial answer",
        status,
        given_reason,
        prompt_tokens=3,
        completion_tokens=9,
        cached_tokens=2,
    )
    assert (answer.role, answer.status, answer.reply_id) == (Role.ASSISTANT, status, reply.id)
    assert (answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens) == (3, 9, 2)
    assert await store.list_messages(conv.id) == [msg, answer]

    stored = await store.get_reply(reply.id)
    assert stored is not None
    assert (stored.state, stored.finish_reason, stored.replica_id, stored.last_event_id) == (
        state,
        reason,
        "r17",
        3,
    )
    assert stored.finished and stored.finished_at is not None
    assert (await store.get_conversation(conv.id, "u1")).updated_at == answer.created_at


async def test_final_states_are_final(store: ConversationStore) -> None:
    conv, msg, reply = await _turn(store)
    # A Stop and the last token race: exactly one outcome is stored, both callers see it.
    first, second = await asyncio.gather(
        store.finish_reply(reply.id, "all of it", MessageStatus.COMPLETE, "stop", completion_tokens=4),
        store.finish_reply(reply.id, "some of it", MessageStatus.STOPPED, completion_tokens=2),
    )
    assert first == second
    assistants = [m for m in await store.list_messages(conv.id) if m.role is Role.ASSISTANT]
    assert assistants == [first]
    with pytest.raises(ReplyFinished):
        await store.update_reply(reply.id, last_event_id=99)
    # The second writer that needs nothing back (the recorder) learns only that it came second.
    assert await store.finish_reply(reply.id, "late", MessageStatus.COMPLETE, look_up_existing=False) is None
    assert await store.finish_reply("rep_missing", "x", MessageStatus.COMPLETE, look_up_existing=False) is None
    assert [m for m in await store.list_messages(conv.id) if m.role is Role.ASSISTANT] == [first]

    _, shed_msg, shed = await _turn(store, conv=conv)
    shed = await store.update_reply(shed.id, state=ReplyState.SHED)
    assert shed is not None and shed.finished_at is not None
    with pytest.raises(ReplyFinished) as err:
        await store.finish_reply(shed.id, "late", MessageStatus.COMPLETE)
    assert err.value.state is ReplyState.SHED
    assert await store.get_reply_for_message(conv.id, shed_msg.id) == shed
    assert (await store.get_reply_for_message(conv.id, msg.id)).id == reply.id


async def test_a_shed_turn_is_stored_final_and_its_resend_gets_a_reply_of_its_own(store: ConversationStore) -> None:
    conv, msg, shed = await _turn(store, shed=True, job={"model": "m", "lane": "free"})
    assert shed.state is ReplyState.SHED and shed.finished_at is not None
    assert (await store.get_reply(shed.id)).state is ReplyState.SHED
    assert shed.id not in {r.id for r in await store.list_unfinished_replies()}
    again = await store.add_reply(conv.id, msg.id, [1, 2, 3], "replica-1", {"model": "m", "lane": "free"})
    newest = await store.get_reply_for_message(conv.id, msg.id)
    assert newest.id == again.id != shed.id and newest.state is ReplyState.QUEUED
    assert newest.prompt_token_ids == [1, 2, 3] and newest.replica_id == "replica-1"
    assert (await store.get_reply(shed.id)).state is ReplyState.SHED


async def test_a_started_reply_runs_unless_it_is_final_and_its_job_reads_alone(store: ConversationStore) -> None:
    job = {"model": "smollm2", "meta": {"user": "u1", "tier": "paid"}}
    _, _, reply = await _turn(store, prompt_token_ids=list(range(3000)), job=job)
    assert await store.get_reply_jobs([reply.id, "rep_missing"]) == {reply.id: job}
    assert await store.mark_running_many([(reply.id, "replica-7")]) == 1
    running = await store.get_reply(reply.id)
    assert (running.state, running.replica_id, running.prompt_token_ids) == (ReplyState.RUNNING, "replica-7",
                                                                              list(range(3000)))
    await store.finish_reply(reply.id, "done", MessageStatus.COMPLETE, "stop")
    # A late "started" report (the finished one got there first) changes nothing.
    assert await store.mark_running_many([(reply.id, "replica-8")]) == 0
    final = await store.get_reply(reply.id)
    assert (final.state, final.replica_id) == (ReplyState.FINISHED, "replica-7")
    assert await store.mark_running_many([("rep_missing", "replica-7")]) == 0


async def test_batches_of_ended_and_started_replies_take_one_call_each(store: ConversationStore) -> None:
    """What the reply recorder does with a batch of reports: mark the started ones running, read
    the ended ones' jobs, store their usage; each in one round trip, each with the single call's
    rules (a final reply stays final, a second record of a reply is not stored)."""
    replies = [(await _turn(store, job={"model": "m", "meta": {"user": f"u{i}"}}))[2] for i in range(3)]
    _, _, no_job = await _turn(store)
    done, running, fresh = replies
    await store.finish_reply(done.id, "done", MessageStatus.COMPLETE, "stop")
    assert await store.mark_running_many([(r.id, "replica-1") for r in replies] + [("rep_missing", "replica-1")]) == 2
    assert [(await store.get_reply(r.id)).state for r in replies] == [ReplyState.FINISHED, ReplyState.RUNNING,
                                                                        ReplyState.RUNNING]
    assert await store.mark_running_many([]) == 0
    jobs = await store.get_reply_jobs([r.id for r in replies] + [no_job.id, "rep_missing"])
    assert jobs == {r.id: {"model": "m", "meta": {"user": f"u{i}"}} for i, r in enumerate(replies)}

    def record(reply: Reply, cost: float) -> UsageRecord:
        return UsageRecord(id=new_id("usage"), reply_id=reply.id, user_id="u", model="m", tier="paid", cost=cost,
                           created_at=now(), day="2026-11-30")

    assert await store.add_usage_many([record(done, 1.0)]) == {done.id}
    stored = await store.add_usage_many([record(done, 2.0), record(running, 3.0), record(fresh, 4.0)])
    assert stored == {running.id, fresh.id}
    assert [(await store.get_usage(r.id)).cost for r in replies] == [1.0, 3.0, 4.0]  # the first record stays
    assert await store.add_usage_many([]) == set()
    assert await store.add_usage_many([record(fresh, 5.0)]) == set()

    # Ended replies saved together: the one saved already keeps its message, the others get theirs.
    await store.finish_replies([Ending(r.id, f"text {r.id}", MessageStatus.COMPLETE, "length", 3, 5, 1, 6)
                                for r in (done, running, fresh)] + [Ending("rep_missing", "x", MessageStatus.COMPLETE)])
    await store.finish_replies([Ending(fresh.id, "too late", MessageStatus.STOPPED, "stop")])
    for r, text in ((done, "done"), (running, f"text {running.id}"), (fresh, f"text {fresh.id}")):
        stored = await store.get_reply(r.id)
        message = next(m for m in await store.list_messages(stored.conversation_id) if m.reply_id == r.id)
        assert (message.text, stored.state) == (text, ReplyState.FINISHED)
    message = next(m for m in await store.list_messages(running.conversation_id) if m.reply_id == running.id)
    assert (message.completion_tokens, message.cached_tokens, (await store.get_reply(running.id)).last_event_id) == \
        (5, 1, 6)


async def test_update_reply_fields(store: ConversationStore) -> None:
    _, _, reply = await _turn(store, prompt_token_ids=[1])
    moved = await store.update_reply(reply.id, state="RESUMING", replica_id="r42", last_event_id=212)
    assert moved is not None and (moved.state, moved.replica_id, moved.last_event_id) == (
        ReplyState.RESUMING,
        "r42",
        212,
    )
    assert moved.finished_at is None
    assert await store.update_reply("rep_missing", last_event_id=1) is None
    with pytest.raises(TypeError):
        await store.update_reply(reply.id, conversation_id="elsewhere")
    with pytest.raises(NotFound):
        await store.finish_reply("rep_missing", "x", MessageStatus.COMPLETE)


async def test_unfinished_replies_keep_their_context(open_store: StoreFactory) -> None:
    store = open_store()
    await store.init()
    prompt = list(range(2000))  # a realistic context, to continue after the token log expired
    conv, _, running = await _turn(store, prompt_token_ids=prompt)
    await store.update_reply(running.id, state=ReplyState.RUNNING, replica_id="r17", last_event_id=212,
                             context_text="ctx")
    _, _, finished = await _turn(store, prompt_token_ids=[1])
    await store.finish_reply(finished.id, "ok", MessageStatus.COMPLETE)
    _, _, queued = await _turn(store)
    await store.update_reply(queued.id, context_text="only text")
    await store.close()

    # A restarted process finds them, oldest first, with everything needed to resume.
    reopened = open_store()
    await reopened.init()
    try:
        unfinished = await reopened.list_unfinished_replies()
        assert [r.id for r in unfinished] == [running.id, queued.id]
        assert unfinished[0].prompt_token_ids == prompt and unfinished[0].context_text == "ctx"
        assert (unfinished[0].state, unfinished[0].replica_id, unfinished[0].last_event_id) == (
            ReplyState.RUNNING,
            "r17",
            212,
        )
        assert unfinished[1].prompt_token_ids is None and unfinished[1].context_text == "only text"
    finally:
        await reopened.close()


async def _alembic_heads(store: SqlConversationStore) -> set[str]:
    def current(conn: sa.Connection) -> set[str]:
        return set(MigrationContext.configure(conn).get_current_heads())

    async with store._engine.connect() as conn:
        return await conn.run_sync(current)


async def test_init_is_idempotent_and_matches_schema(store: SqlConversationStore) -> None:
    conv, _, _ = await _turn(store)
    await store.init()
    await asyncio.gather(store.init(), store.init())  # concurrent starters too
    assert await store.get_conversation(conv.id, "u1") is not None
    assert await _alembic_heads(store) == set(ScriptDirectory.from_config(alembic_config()).get_heads())

    def diff(conn: sa.Connection) -> list:
        # Partitions are PostgreSQL's storage, not model tables.
        def include(obj, name, type_, reflected, compare_to) -> bool:
            if type_ == "foreign_key_constraint":
                name = obj.referred_table.name  # PostgreSQL mirrors an FK onto each partition
            return not (name or "").startswith("messages_p")

        ctx = MigrationContext.configure(conn, opts={"include_object": include})
        return compare_metadata(ctx, every_table)

    # The migrations make memory's, files' and the vector index's tables too, in the same database
    # (the vectors' embedding as bytes: these servers have no pgvector).
    from fairway.files.store import metadata as files_metadata
    from fairway.memory.store import metadata as memory_metadata
    from fairway.retrieval.sql_index import DEFAULT_DIM, _tables

    every_table = sa.MetaData()
    for part in (metadata, memory_metadata, files_metadata, _tables(DEFAULT_DIM, False)[0]):
        for table in part.tables.values():
            table.to_metadata(every_table)

    async with store._engine.connect() as conn:
        assert await conn.run_sync(diff) == []


async def test_a_database_whose_parts_made_their_own_tables_migrates_in_place(open_store: StoreFactory) -> None:
    """Before revision 0006 memory, files and the vector index made their tables themselves
    (create_all): such a database goes to head keeping their rows, and flagged messages keep
    their categories from 0007 on."""
    from alembic import command

    from fairway.files.store import metadata as files_metadata
    from fairway.memory.store import memories
    from fairway.memory.store import metadata as memory_metadata
    from fairway.retrieval.sql_index import DEFAULT_DIM, _tables

    store = open_store()

    def to_0005(conn: sa.Connection) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0005")

    try:
        async with store._engine.begin() as conn:
            await conn.run_sync(to_0005)
            for part in (memory_metadata, files_metadata, _tables(DEFAULT_DIM, False)[0]):
                await conn.run_sync(part.create_all)
            await conn.execute(sa.insert(memories).values(memory_id="mem_1", user_id="u1", fact="likes tea",
                                                          conversation_id=None, created_at=1.0, updated_at=1.0))
        await store.init()
        assert await _alembic_heads(store) == set(ScriptDirectory.from_config(alembic_config()).get_heads())
        async with store._engine.connect() as conn:
            assert (await conn.execute(sa.select(memories.c.fact))).scalars().all() == ["likes tea"]
        conv = Conversation(new_id("conv"), "u1", "free", "m", "t", now(), now())
        flagged, _ = await store.store_turn(NewTurn(conv, True, [(Role.USER, "a threat")], "k1", flagged=True,
                                                    flagged_categories=["violence", "harassment"]))
        (kept,) = await store.list_messages(conv.id)
        assert (kept.status, kept.flagged_categories) == (MessageStatus.FLAGGED, ["violence", "harassment"])
    finally:
        await store.close()


async def test_messages_are_hash_partitioned_on_postgres(store: SqlConversationStore) -> None:
    if store._dialect != "postgresql":
        pytest.skip("partitioning is PostgreSQL only")
    async with store._engine.connect() as conn:
        strategy = await conn.scalar(
            sa.text("SELECT partstrat::text FROM pg_partitioned_table WHERE partrelid = 'messages'::regclass")
        )
        parts = await conn.scalar(
            sa.text("SELECT count(*) FROM pg_inherits WHERE inhparent = 'messages'::regclass")
        )
    assert (strategy, parts) == ("h", 8)

    # Rows really spread over the partitions.
    for _ in range(16):
        await _turn(store)
    async with store._engine.connect() as conn:
        used = await conn.scalar(sa.text("SELECT count(DISTINCT tableoid) FROM messages"))
    assert used > 1


async def test_connections_the_server_closed_are_replaced_without_failing_a_request(
    store: SqlConversationStore, pg_database: str | None
) -> None:
    """PostgreSQL restarted, or killed idle connections: the pools still hold them, and the next
    requests get new ones instead of an error (checked at checkout, without a round trip)."""
    if store._dialect != "postgresql":
        pytest.skip("pooled server connections are PostgreSQL only")
    conv, _, _ = await _turn(store)
    # Hold several connections at once so both pools keep more than one: the chat path's own
    # (hot_path: history, conversation) and the engine's (listing conversations).
    await asyncio.gather(*(store.list_messages(conv.id) for _ in range(4)),
                         *(store.list_conversations("u1") for _ in range(4)))
    assert pg_database is not None
    name = pg_database.rsplit("/", 1)[1]
    await pg_admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' "
                   "AND pid <> pg_backend_pid() AND application_name = ''")
    await asyncio.sleep(0.3)  # the closed sockets reach the pooled connections
    for _ in range(6):
        assert (await store.get_conversation(conv.id, "u1")) is not None
        assert [c.id for c in await store.list_conversations("u1")] == [conv.id]


async def test_chat_path_statements_share_a_bounded_pool_and_drop_a_cancelled_one(
    store: SqlConversationStore,
) -> None:
    """On PostgreSQL the chat path's statements run on asyncpg's pool (hot_path): many at once
    queue for at most its connections; a statement cancelled midway (a client gone, a timeout)
    leaves no half-used connection behind, and the next ones run."""
    if store._dialect != "postgresql":
        pytest.skip("the hot path is PostgreSQL only")
    hot = store._hot_path
    assert hot is not None
    conv, _, reply = await _turn(store)
    replies = await asyncio.gather(*(store.get_reply(reply.id) for _ in range(3 * hot._size)))
    assert {r.id for r in replies} == {reply.id}
    pool = hot._pool
    assert pool is not None and 1 <= pool.get_size() <= hot._size
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(hot.fetch(sa.select(sa.func.pg_sleep(5)), {}), 0.2)
    assert (await store.get_conversation(conv.id, "u1")) is not None
    await asyncio.gather(*(store.list_messages(conv.id) for _ in range(4)))
    for _ in range(100):  # the cancelled one comes back once PostgreSQL confirms the cancel
        if pool.get_idle_size() == pool.get_size():
            break
        await asyncio.sleep(0.02)
    assert pool.get_idle_size() == pool.get_size()  # every connection given back
    assert hot._pool is pool  # the same pool throughout


async def test_a_batch_in_one_connection_takes_one_checkout_and_its_statements_still_stand_alone(
    store: SqlConversationStore,
) -> None:
    """store.one_connection() (the recorder's batches): the calling task's statements run on one
    pooled connection, nested blocks included, while other tasks take their own; a statement that
    fails inside (a duplicate) leaves the next ones running, each committed by itself; after the
    block the connection is back in the pool. Off the pool (SQLite) the block changes nothing."""
    conv, _, reply = await _turn(store)
    if store._dialect != "postgresql":
        async with store.one_connection():
            assert (await store.get_reply(reply.id)) is not None
        return
    hot = store._hot_path
    assert hot is not None
    backend = sa.select(sa.func.pg_backend_pid())

    async def pid() -> int:
        return (await hot.fetch(backend, {}))[0][0]

    async with store.one_connection():
        mine = {await pid() for _ in range(5)}
        async with store.one_connection():
            mine.add(await pid())
        others = set(await asyncio.gather(*(pid() for _ in range(3))))  # tasks of their own
        with pytest.raises(IntegrityError):  # the same primary key twice
            await hot.fetch(sa.insert(conversations), _values(conv))
        assert (await store.get_reply(reply.id)) is not None
        mine.add(await pid())
        pool = hot._pool
        assert pool is not None and pool.get_idle_size() == pool.get_size() - 1
    assert len(mine) == 1 and not mine & others
    assert pool.get_idle_size() == pool.get_size()
    assert (await store.get_conversation(conv.id, "u1")) is not None


async def _killed_midway(admin: asyncpg.Connection, lock_row: str, call: Awaitable[Any]) -> None:
    """Run call while admin holds the row it needs (so it waits on its connection), kill the
    connection under it, and expect StoreUnavailable, in bounded time."""
    async with admin.transaction():
        await admin.execute(f"{lock_row} FOR UPDATE")
        blocked = asyncio.ensure_future(asyncio.wait_for(call, 10))
        await terminate_lock_waiters(admin)
        with pytest.raises(StoreUnavailable):
            await blocked


async def test_a_connection_killed_mid_call_fails_that_call_as_unavailable_and_the_next_succeeds(
    store: SqlConversationStore, pg_database: str | None
) -> None:
    """PostgreSQL drops a connection while a call runs on it (an admin's pg_terminate_backend, a
    failover): that call fails at once with StoreUnavailable (the gateway answers 503) and never
    hangs; the next call gets a new connection and succeeds. Both pools: the chat path's
    (finish_reply, one statement) and the engine's transactions (delete_conversation)."""
    if store._dialect != "postgresql":
        pytest.skip("server connections are PostgreSQL only")
    assert pg_database is not None
    conv, msg, reply = await _turn(store)
    async with store._engine.connect() as probe:
        schema = await probe.scalar(sa.text("SELECT current_schema()"))
    admin = await asyncpg.connect(pg_database, server_settings={"search_path": schema})
    try:
        await _killed_midway(admin, f"SELECT 1 FROM replies WHERE id = '{reply.id}'",
                             store.finish_reply(reply.id, "lost", MessageStatus.COMPLETE, "stop"))
        assert (await store.get_reply(reply.id)).state is ReplyState.QUEUED  # nothing of it stored
        answer = await store.finish_reply(reply.id, "answer", MessageStatus.COMPLETE, "stop")
        assert await store.list_messages(conv.id) == [msg, answer]

        await _killed_midway(admin, f"SELECT 1 FROM conversations WHERE id = '{conv.id}'",
                             store.delete_conversation(conv.id, "u1"))
        assert await store.get_conversation(conv.id, "u1") is not None
        assert await store.delete_conversation(conv.id, "u1") is True
        assert await store.get_conversation(conv.id, "u1") is None
    finally:
        await admin.close()


async def test_an_unreachable_database_fails_fast_as_unavailable() -> None:
    """Nothing listens where the store points (PostgreSQL down): every call raises StoreUnavailable
    at once, the chat path's and the engine's alike, and init too."""
    store = make_store("postgresql://postgres@127.0.0.1:1/fairway")
    try:
        for call in (store.init(), store.get_conversation("conv_x", "u1"), store.list_conversations("u1"),
                     store.finish_replies([Ending("rep_x", "x", MessageStatus.COMPLETE)])):
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(call, 10)
    finally:
        await store.close()


def test_database_urls(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert database_url("postgresql://root@db/x") == "postgresql+asyncpg://root@db/x"
    assert database_url("postgres://root@db/x") == "postgresql+asyncpg://root@db/x"
    assert database_url("sqlite:///a.db") == "sqlite+aiosqlite:///a.db"
    assert database_url("postgresql+asyncpg://db/x") == "postgresql+asyncpg://db/x"
    monkeypatch.chdir(tmp_path)
    assert database_url(None) == f"sqlite+aiosqlite:///{tmp_path / '.fairway' / 'fairway.db'}"


async def test_default_store_is_a_sqlite_file_under_dot_fairway(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = make_store(None)
    try:
        await store.init()
        await _turn(store)
    finally:
        await store.close()
    assert (tmp_path / ".fairway" / "fairway.db").is_file()


async def test_in_memory_sqlite_shares_one_database() -> None:
    store = make_store("sqlite+aiosqlite://")
    try:
        await store.init()
        conv, msg, _ = await _turn(store)
        assert await store.list_messages(conv.id) == [msg]
    finally:
        await store.close()


def test_reply_state_machine() -> None:
    S = ReplyState
    assert S.QUEUED.can_become(S.RUNNING) and S.RUNNING.can_become(S.PREEMPTED)
    assert S.PREEMPTED.can_become(S.QUEUED) and S.RESUMING.can_become(S.QUEUED)
    assert S.QUEUED.can_become(S.SHED) and not S.RUNNING.can_become(S.SHED)
    assert not S.QUEUED.can_become(S.FINISHED)
    assert all(not s.can_become(S.QUEUED) for s in (S.FINISHED, S.STOPPED, S.FLAGGED, S.SHED))


async def test_messages_keep_their_tool_calls(store: ConversationStore) -> None:
    # A client's assistant message with calls and the tool result it got back, then our reply's
    # calls (a built-in run at its text offset): all three kinds of message's tools, on both backends.
    conversation = _new_conversation()
    calls = {"calls": [{"id": "c1", "name": "f", "arguments": '{"a": 1}', "status": "call", "index": 0, "at": 0}]}
    msg, reply = await store.store_turn(NewTurn(conversation, True, [
        (Role.USER, "q"), (Role.ASSISTANT, "", calls), (Role.TOOL, "result", {"tool_call_id": "c1"})], "key-t"))
    ran = {"calls": [{"id": "c2", "name": "execute_code", "arguments": '{"code": "print(1)"}', "status": "completed",
                      "index": 0, "at": 5, "output": "1", "detail": {"stdout": "1\n", "exit_code": 0}}]}
    await store.finish_reply(reply.id, "Done. It printed 1.", MessageStatus.COMPLETE, "stop", tools=ran)
    await store.finish_replies([Ending(reply.id, "again", MessageStatus.COMPLETE, tools=ran)])  # second writer: no-op
    stored = await store.list_messages(conversation.id)
    assert [(str(m.role), m.text, m.tools) for m in stored] == [
        ("user", "q", None), ("assistant", "", calls), ("tool", "result", {"tool_call_id": "c1"}),
        ("assistant", "Done. It printed 1.", ran)]


async def test_a_user_message_keeps_the_files_it_attached(store: ConversationStore) -> None:
    """Each user message's files are stored with it, in the turn's one write, and read back on that
    message: not on the answer, nor on a later turn without files; a refused (flagged) turn keeps
    its own, as does a resend's duplicate."""
    conversation = _new_conversation()
    notes = Attachment("file_a", "notes.txt", 23, "text/plain")
    report = Attachment("file_b", "report.pdf", 1024, "application/pdf")
    first, reply = await store.store_turn(NewTurn(conversation, True, [
        (Role.SYSTEM, "be brief"), (Role.USER, "q1", None, [notes, report])], "k1"))
    assert first.attachments == [notes, report]
    await store.finish_reply(reply.id, "a1", MessageStatus.COMPLETE)
    _, reply = await store.store_turn(NewTurn(conversation, False, [(Role.USER, "q2", None, [])], "k2"))
    await store.finish_reply(reply.id, "a2", MessageStatus.COMPLETE)
    await store.store_turn(NewTurn(conversation, False, [(Role.USER, "a threat", None, [report])], "k3",
                                   flagged=True, flagged_categories=["violence"]))
    stored = await store.list_messages(conversation.id)
    assert [(m.text, m.attachments) for m in stored] == [
        ("be brief", None), ("q1", [notes, report]), ("a1", None), ("q2", None), ("a2", None), ("a threat", [report])]
    with pytest.raises(DuplicateClientKey) as dup:
        await store.store_turn(NewTurn(conversation, False, [(Role.USER, "q1", None, [notes])], "k1"))
    assert dup.value.existing.attachments == [notes, report]


async def test_text_postgresql_refuses_is_invalid_text_on_every_path(pg_database: str | None) -> None:
    """PostgreSQL refuses a NUL in any text (SQLSTATE 22021; SQLite stores it): the stores raise
    InvalidText, which the gateway answers with a 400, whichever way the statement went (asyncpg's
    pool on the chat path, the engine elsewhere; memory's and files' tables alike). It was an
    asyncpg or SQLAlchemy error, a 500."""
    from fairway.files.store import FileRecord, FileStore

    settings = await _fresh_schema(pg_database)
    store = SqlConversationStore(database_url(pg_database), connect_args=settings)
    files = FileStore(database_url(pg_database), connect_args=settings)
    await store.init()
    try:
        with pytest.raises(InvalidText):  # the chat path's one statement, on asyncpg's pool
            await store.store_turn(NewTurn(_new_conversation(), True, [(Role.USER, "hi\x00there")], "k-nul"))
        with pytest.raises(InvalidText):  # a read on the same pool
            await store.get_conversation("conv\x00", "u1")
        with pytest.raises(InvalidText):  # through the engine
            await store.list_conversations("u\x00")
        with pytest.raises(InvalidText):  # through the engine, in a transaction
            await store.delete_conversation("conv\x00", "u1")
        with pytest.raises(InvalidText):  # files' tables, through their engine
            await files.add(FileRecord("file-nul", "u1", "a\x00.txt", "assistants", "text/plain", 1, "ready", None,
                                       0, "key", now()))
        with pytest.raises(InvalidText):  # and on their pool
            await files.attached("conv\x00")
        assert await store.list_conversations("u1") == []  # nothing was stored, and the store still works
    finally:
        await files.close()
        await store.close()
