"""Memory across conversations: the service on the real embedding model and SQLite, and the whole
loop through `fairway serve`'s app with the real model over HTTP: a fact said in one conversation
is extracted, listed, injected into the next conversation's system block, and gone after DELETE."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from serving import (
    API_KEY,
    MODEL,
    OTHER_KEY,
    TEST_KEYS,
    ThreadServer,
    chat_body,
    headers,
    wait_for,
    wait_ready,
)

from fairway.conversation import database_url
from fairway.memory import MemoryService, MemoryStore
from fairway.memory.complete import ModelUnavailable, fit_prompt
from fairway.memory.extract import EXTRACTION_PROMPT, model_facts, transcript
from fairway.retrieval import SqlVectorIndex

pytest_plugins = ["vector_backends"]  # its fixtures: the databases, the embedder


@pytest.fixture
async def memory(vector_db, embedder):  # noqa: F811 - the imported fixture
    """The service on SQLite, PostgreSQL 15 (exact search) and PostgreSQL with pgvector."""
    url, connect_args = vector_db
    url = database_url(url)
    service = MemoryService(MemoryStore(url, connect_args), SqlVectorIndex(url, connect_args=connect_args),
                            lambda: embedder)
    await service.init()
    yield service
    await service.close()


async def test_a_restated_fact_replaces_the_old_one(memory: MemoryService):
    first = await memory.extract("u1", "conv_a", [("user", "Hi, I prefer Python for scripting.")])
    assert [m.fact for m in first] == ["User prefers Python for scripting."]
    again = await memory.remember("u1", ["User prefers Python for scripts."], "conv_b")
    assert again[0].memory_id == first[0].memory_id  # the same memory, updated
    facts = await memory.list("u1")
    assert [(m.fact, m.conversation_id) for m in facts] == [("User prefers Python for scripts.", "conv_b")]
    await memory.remember("u1", ["User is allergic to peanuts."], "conv_b")
    assert len(await memory.list("u1")) == 2  # a different fact is added
    assert await memory.list("u2") == []


async def test_one_gateway_extracts_each_idle_conversation(memory: MemoryService):
    await memory.store.note_turn("u1", "conv_idle", [])
    idle = await memory.store.idle_conversations(0.0)
    assert [c for _, c, _ in idle] == ["conv_idle"]
    assert await memory.store.claim_messages("u1", "conv_idle", 0, 2)
    assert not await memory.store.claim_messages("u1", "conv_idle", 0, 2)  # the second gateway skips them
    assert await memory.store.extracted_messages("conv_idle") == 2
    assert await memory.store.idle_conversations(0.0) == []
    await memory.store.note_turn("u1", "conv_idle")  # a new turn: extracted again later
    assert [c for _, c, _ in await memory.store.idle_conversations(0.0)] == ["conv_idle"]


async def test_each_message_is_extracted_once_so_a_deleted_memory_stays_deleted(memory: MemoryService):
    """On demand or when idle, extraction reads only the messages no extraction read before: a
    deleted memory is not learnt again from the messages it came from, a new statement is."""
    chat = [("user", "My name is Qorvath."), ("assistant", "Nice to meet you.")]
    memory.messages_of = _messages_of({"conv_q": chat})
    await memory.store.note_turn("u1", "conv_q", [])
    (name,) = await memory.extract("u1", "conv_q", chat, use_model=False)
    assert name.fact == "User's name is Qorvath."
    assert await memory.store.idle_conversations(0.0) == []  # on demand counts as its extraction
    assert await memory.forget("u1", name.memory_id)
    assert await memory.extract("u1", "conv_q", chat) == []  # asked again: nothing new to read
    chat += [("user", "I live in Zorbtown."), ("assistant", "Lovely.")]
    await memory.store.note_turn("u1", "conv_q")
    memory.settings.idle_s = 0.0
    assert await memory.extract_idle() == 1
    assert [m.fact for m in await memory.list("u1")] == ["User lives in Zorbtown."]
    assert await memory.extract_idle() == 0
    chat += [("user", "Again: my name is Qorvath.")]  # the user says it anew
    assert [m.fact for m in await memory.extract("u1", "conv_q", chat)] == ["User's name is Qorvath."]


async def test_the_idle_pass_waits_for_the_extraction_model(memory: MemoryService):
    """With no replica serving the model yet (a deployment starting), the idle pass reads nothing:
    it would claim the messages and learn only their explicit statements, for good."""

    class Model:
        up = False

        async def ready(self) -> bool:
            return self.up

        async def __call__(self, messages) -> str:
            return '{"facts": ["User likes sailing."]}'

    memory.complete = model = Model()
    memory.messages_of = _messages_of({"conv_w": [("user", "I go sailing every weekend."), ("assistant", "Nice.")]})
    memory.settings.idle_s = 0.0
    await memory.store.note_turn("u1", "conv_w", [])
    assert await memory.extract_idle() == 0
    assert await memory.store.extracted_messages("conv_w") == 0
    model.up = True
    assert await memory.extract_idle() == 1
    assert [m.fact for m in await memory.list("u1")] == ["User likes sailing."]


async def test_messages_the_model_could_not_read_are_read_again(memory: MemoryService):
    """The extraction model failed (its replica went, the job errored): the idle pass reads the
    same messages again later, rather than their durable facts being lost for good; the explicit
    statement learnt the first time is not doubled."""
    from fairway.memory.complete import ModelUnavailable

    class Model:
        fails = 1

        async def ready(self) -> bool:
            return True

        async def __call__(self, messages) -> str:
            if self.fails:
                self.fails -= 1
                raise ModelUnavailable("the extraction job failed: replica gone")
            return '{"facts": ["User likes sailing."]}'

    memory.complete = Model()
    memory.messages_of = _messages_of({"conv_f": [("user", "My name is Ada. I go sailing every weekend."),
                                                  ("assistant", "Nice.")]})
    memory.settings.idle_s = 0.0
    await memory.store.note_turn("u1", "conv_f", [])
    assert await memory.extract_idle() == 1
    assert [m.fact for m in await memory.list("u1")] == ["User's name is Ada."]
    assert await memory.store.extracted_messages("conv_f") == 0  # given back
    assert await memory.extract_idle() == 1
    assert sorted(m.fact for m in await memory.list("u1")) == ["User likes sailing.", "User's name is Ada."]
    assert await memory.store.extracted_messages("conv_f") == 2
    assert await memory.extract_idle() == 0


def _messages_of(conversations: dict[str, list[tuple[str, str]]]):
    async def messages_of(conversation_id: str) -> list[tuple[str, str]]:
        return list(conversations[conversation_id])

    return messages_of


async def test_a_conversation_started_with_memory_off_keeps_no_block(memory: MemoryService):
    await memory.remember("u1", ["User is allergic to peanuts."], "conv_a")
    await memory.store.set_enabled("u1", False)
    assert (await memory.block("u1", "conv_off", "Suggest a snack for my hike")).memories == []
    await memory.store.set_enabled("u1", True)
    assert (await memory.block("u1", "conv_off", "Suggest a snack for my hike")).memories == []
    assert (await memory.block("u1", "conv_on", "Suggest a snack for my hike")).memories != []


async def test_the_block_is_chosen_once_and_loses_deleted_memories(memory: MemoryService):
    written = await memory.remember("u1", ["User is allergic to peanuts.", "User lives in Lisbon.",
                                           "User's name is Ada."], "conv_a")
    block = await memory.block("u1", "conv_new", "Suggest a snack for my hike")
    assert [m.fact for m in block.memories][0] == "User is allergic to peanuts."
    assert block.message["role"] == "system" and "- User is allergic to peanuts." in block.message["content"]
    # a later turn asks about something else: the same block (the prompt prefix stays the same)
    later = await memory.block("u1", "conv_new", "What is the capital of France?")
    assert later.memories == block.memories
    peanuts = next(m for m in written if "peanuts" in m.fact)
    assert await memory.forget("u1", peanuts.memory_id)
    assert not await memory.forget("u1", peanuts.memory_id)
    assert not await memory.forget("u2", written[1].memory_id)  # another user's: not found
    assert peanuts not in (await memory.block("u1", "conv_new", "snack?")).memories
    assert "peanuts" not in str((await memory.block("u1", "conv_other", "Suggest a peanut snack")).message)
    # unrelated question, below the threshold: nothing injected
    assert (await memory.block("u1", "conv_3", "Explain TCP congestion control")).memories == []
    await memory.store.set_enabled("u1", False)
    assert (await memory.block("u1", "conv_new", "snack?")).memories == []
    assert await memory.extract("u1", "conv_x", [("user", "My name is Bob.")]) == []
    await memory.store.set_enabled("u1", True)
    assert await memory.forget_all("u1") == 2
    assert await memory.list("u1") == []


async def test_injection_keeps_to_k_and_the_token_budget(memory: MemoryService):
    facts = ["User is allergic to peanuts.", "User lives in Lisbon.", "User's name is Ada.", "User uses Vim."]
    await memory.remember("u1", facts, "conv_a")
    memory.settings.inject_min_score = -1.0  # every memory qualifies: only k and the budget choose
    memory.settings.inject_k = 2
    two = (await memory.block("u1", "conv_k", "Suggest a snack for my hike")).memories
    assert len(two) == 2 and two[0].fact == "User is allergic to peanuts."
    memory.settings.inject_k = 5
    memory.settings.inject_max_tokens = 10  # "- User is allergic to peanuts." is 8 by the default count
    assert [m.fact for m in (await memory.block("u1", "conv_budget", "Suggest a snack for my hike")).memories] == [
        "User is allergic to peanuts."]


async def test_a_user_without_memories_costs_a_turn_no_embedding(vector_db):
    """The first chats of a new user (memory on, nothing remembered yet) never wait for the
    embedding model to load; the turn is still noted, so idle extraction learns from it."""
    url, connect_args = vector_db
    url = database_url(url)

    def no_embedder():
        raise AssertionError("the embedder was loaded for a user with no memories")

    service = MemoryService(MemoryStore(url, connect_args), SqlVectorIndex(url, connect_args=connect_args),
                            no_embedder)
    await service.init()
    try:
        block = await service.block("new_user", "conv_first", "Suggest a snack for my hike")
        assert block.memories == [] and block.message is None
        assert (await service.block("new_user", "conv_first", "And a drink?")).memories == []
        for _ in range(50):  # the turns are noted for idle extraction a moment later, together
            if [c for _, c, _ in await service.store.idle_conversations(0.0)] == ["conv_first"]:
                break
            await asyncio.sleep(0.05)
        assert [c for _, c, _ in await service.store.idle_conversations(0.0)] == ["conv_first"]
    finally:
        await service.close()


async def test_model_answers_are_validated_and_retried_within_a_bound():
    answers = iter(["Sure! The user likes cats.", '{"facts": "not a list"}',
                    'Here: ```json\n{"facts": ["User works at a bakery", 7]}\n```'])
    asked = []

    async def complete(chat):
        asked.append(chat)
        return next(answers)

    assert await model_facts(complete, [("user", "I work at a bakery")], attempts=3) == []
    assert len(asked) == 3 and "not valid" in asked[-1][-1]["content"]
    answers = iter(['{"facts": []}', "unused"])
    assert await model_facts(complete, [("user", "hello")]) == []
    answers = iter(['noise {"facts": ["User works at a bakery"]} more'])
    assert await model_facts(complete, [("user", "I work at a bakery")]) == ["User works at a bakery."]


def test_an_extraction_prompt_past_the_window_keeps_its_newest_turns():
    """The transcript is cut to 6,000 characters, more tokens than a 1,024-token window holds with
    the answer's: the completer drops its oldest turns to fit rather than have the job refused."""
    from fairway.assembly import load_tokenizer

    tokenizer = load_tokenizer(None)
    turns = [("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "a few words of the chat, " * 6) for i in range(40)]
    chat = [{"role": "system", "content": EXTRACTION_PROMPT},
            {"role": "user", "content": "Conversation:\n" + transcript(turns)}]
    budget = 1024 - 256
    assert len(tokenizer.encode(tokenizer.apply_chat_template(chat))) > budget
    text = tokenizer.decode(fit_prompt(tokenizer, chat, budget))
    assert len(tokenizer.encode(text)) <= budget
    assert EXTRACTION_PROMPT in text and re.search(r"Conversation:\n(user|assistant): turn \d+: ", text)
    kept = [i for i in range(40) if f"turn {i}: " in text]
    assert kept == list(range(kept[0], 40)) and kept[0] > 0  # the newest turns, whole, none skipped
    one_line = [chat[0], {"role": "user", "content": "Conversation:\nuser: " + "word " * 3000}]
    assert len(fit_prompt(tokenizer, one_line, budget)) <= budget  # a single long turn: its end
    with pytest.raises(ModelUnavailable):
        fit_prompt(tokenizer, chat, 20)  # not even the instructions fit


# -- end to end ------------------------------------------------------------------------------


# Users of their own for the tests below, whose memories the tests above do not touch.
MEMORY_KEYS = [("sk-test-memory-3", "test-memory-3", "paid"), ("sk-test-memory-4", "test-memory-4", "paid"),
               ("sk-test-memory-5", "test-memory-5", "paid")]


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedder):
    from fairway.assembly import ServerOptions, embedded_app

    db = tmp_path_factory.mktemp("memory") / "fairway.db"
    options = ServerOptions(database=f"sqlite:///{db}", max_model_len=1024, api_keys=[*TEST_KEYS, *MEMORY_KEYS],
                           memory_idle_s=1.0, memory_poll_s=0.5, memory_extract_tokens=48)
    app = embedded_app(options)
    server = ThreadServer(app).start()
    wait_ready(server.url)
    yield server
    server.stop()


def test_a_fact_from_one_conversation_reaches_the_next_until_deleted(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    first = client.chat.completions.create(model=MODEL, max_tokens=8,
                                           messages=[{"role": "user", "content": "I'm allergic to peanuts."}])
    assert first.model_extra["context"]["memories"] == 0

    # no call: the conversation goes idle (1 s here) and the background job extracts its facts
    def peanut_memory():
        return next((m for m in http.get("/v1/user/memory").json()["memories"] if "peanuts" in m["fact"]), None)

    memory = wait_for(peanut_memory, timeout=90)
    assert memory["fact"] == "User is allergic to peanuts." and memory["conversation_id"] == first.conversation_id
    assert isinstance(memory["created_at"], int) and memory["memory_id"].startswith("mem_")

    second = client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
        {"role": "system", "content": "You are a brief assistant."},
        {"role": "user", "content": "Can you suggest a snack idea for my afternoon?"}])
    context = second.model_extra["context"]
    assert context["memories"] >= 1 and memory["memory_id"] in context["memory_ids"]
    # The next turn keeps the block, so its prompt starts with this one's: the prefix cache serves
    # every full block of it again (system text, memories, the first question).
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={
        "conversation_id": second.conversation_id}, messages=[{"role": "user", "content": "Something sweet?"}])
    assert follow.model_extra["context"]["memory_ids"] == context["memory_ids"]
    assert follow.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens // 16 * 16
    # another user sees none of it, and cannot delete it
    other = httpx.Client(base_url=server.url, headers=headers(OTHER_KEY), timeout=30)
    assert other.get("/v1/user/memory").json()["memories"] == []
    gone = other.delete(f"/v1/user/memory/{memory['memory_id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "memory_not_found"

    assert http.delete(f"/v1/user/memory/{memory['memory_id']}").json()["deleted"] is True
    assert peanut_memory() is None
    third = client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "Can you suggest a snack idea for my evening?"}])
    assert memory["memory_id"] not in third.model_extra["context"].get("memory_ids", [])
    # the second conversation's next turn no longer carries it either
    again = client.chat.completions.create(model=MODEL, max_tokens=8, extra_body={
        "conversation_id": second.conversation_id}, messages=[{"role": "user", "content": "And a drink?"}])
    assert memory["memory_id"] not in again.model_extra["context"].get("memory_ids", [])


def test_memory_switch_extract_on_demand_and_errors(server):
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "My name is Ada Lovelace."}])
    written = http.post("/v1/user/memory/extract", json={"conversation_id": reply.conversation_id}).json()
    assert "User's name is Ada Lovelace." in [m["fact"] for m in written["memories"]]
    assert http.put("/v1/user/memory/settings", json={"enabled": False}).json() == {"enabled": False}
    assert http.get("/v1/user/memory").json()["enabled"] is False
    off = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "What is my name?"}])
    assert off.model_extra["context"]["memories"] == 0
    assert http.put("/v1/user/memory/settings", json={"enabled": True}).status_code == 200
    assert http.delete("/v1/user/memory").json()["deleted"] >= 1
    assert http.get("/v1/user/memory").json()["memories"] == []
    # errors: OpenAI's shape
    bad = http.put("/v1/user/memory/settings", json={"enabled": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"]
    missing = http.post("/v1/user/memory/extract", json={"conversation_id": "conv_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "conversation_not_found"
    assert httpx.get(f"{server.url}/v1/user/memory").status_code == 401
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"404", "401"} <= set(paths["/v1/user/memory/{memory_id}"]["delete"]["responses"])


def _clients(server, key: str) -> tuple[openai.OpenAI, httpx.Client]:
    return (openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120),
            httpx.Client(base_url=server.url, headers=headers(key), timeout=120))


def test_a_deleted_memory_is_not_learnt_again_from_its_messages(server):
    """The exploratory pass's repro: a fact extracted on demand, then deleted, came back at the
    next idle extraction of its conversation (a new id, injected into later chats again)."""
    client, http = _clients(server, MEMORY_KEYS[0][0])

    def facts() -> list[str]:
        return [m["fact"] for m in http.get("/v1/user/memory").json()["memories"]]

    first = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "My name is Qorvath."}])
    cid = first.conversation_id
    (name,) = http.post("/v1/user/memory/extract", json={"conversation_id": cid, "use_model": False}).json()["memories"]
    assert name["fact"] == "User's name is Qorvath."
    assert http.delete(f"/v1/user/memory/{name['memory_id']}").status_code == 200
    assert facts() == []
    # Idle extraction (1 s here) takes the conversations oldest first: once a later one's fact is
    # learnt, the pass has been over the first (which an on-demand extraction counts for).
    client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "I live in Zorbtown."}])
    wait_for(lambda: "User lives in Zorbtown." in facts(), timeout=90)
    assert "User's name is Qorvath." not in facts()
    # on demand again: its messages were read already
    again = http.post("/v1/user/memory/extract", json={"conversation_id": cid, "use_model": False})
    assert again.status_code == 200 and again.json()["memories"] == []
    # the user adds a turn: its new messages are extracted, not the old ones again
    client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"conversation_id": cid},
                                   messages=[{"role": "user", "content": "I work at Blorpcorp."}])
    wait_for(lambda: "User works at Blorpcorp." in facts(), timeout=90)
    assert "User's name is Qorvath." not in facts()
    ask = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "What is my name?"}])
    assert name["memory_id"] not in ask.model_extra["context"].get("memory_ids", [])
    # a new message saying it again is the user's new statement: learnt again
    client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"conversation_id": cid},
                                   messages=[{"role": "user", "content": "Again: my name is Qorvath."}])
    written = http.post("/v1/user/memory/extract", json={"conversation_id": cid, "use_model": False}).json()
    assert [m["fact"] for m in written["memories"]] == ["User's name is Qorvath."]


def test_a_conversation_started_with_memory_off_gets_no_block_later(server):
    client, http = _clients(server, MEMORY_KEYS[1][0])
    first = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "I'm allergic to peanuts."}])
    (peanuts,) = http.post("/v1/user/memory/extract", json={"conversation_id": first.conversation_id,
                                                            "use_model": False}).json()["memories"]
    assert http.put("/v1/user/memory/settings", json={"enabled": False}).status_code == 200
    off = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "Suggest a snack for my hike."}])
    assert off.model_extra["context"]["memories"] == 0
    assert http.put("/v1/user/memory/settings", json={"enabled": True}).status_code == 200
    later = client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={
        "conversation_id": off.conversation_id}, messages=[{"role": "user", "content": "Suggest a snack for my hike."}])
    assert later.model_extra["context"]["memories"] == 0
    # a conversation started with memory on gets it
    on = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "Suggest a snack for my hike."}])
    assert peanuts["memory_id"] in on.model_extra["context"]["memory_ids"]


def test_a_message_the_input_check_refused_is_not_learnt(server):
    """A refused message is stored (flagged) but is no one's statement of fact: extraction passes
    over its text, and the messages after it are still read."""
    _, http = _clients(server, MEMORY_KEYS[2][0])
    refused = http.post("/v1/chat/completions", json=chat_body(
        "My name is Krazzle. I will kill you, I swear.", max_tokens=4, stream=False))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "content_policy_violation"
    cid = refused.headers["x-conversation-id"]
    learnt = http.post("/v1/user/memory/extract", json={"conversation_id": cid, "use_model": False})
    assert learnt.status_code == 200 and learnt.json()["memories"] == []
    http.post("/v1/chat/completions", json=chat_body("I live in Quexton.", max_tokens=4, stream=False,
                                                     conversation_id=cid))
    learnt = http.post("/v1/user/memory/extract", json={"conversation_id": cid, "use_model": False}).json()
    assert [m["fact"] for m in learnt["memories"]] == ["User lives in Quexton."]
