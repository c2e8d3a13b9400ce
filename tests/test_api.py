"""The chat API end to end, as users see it: `fairway serve`'s app (bundled model on the CPU,
in-process token log, SQLite) over real HTTP, driven with the official openai SDK and raw SSE."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
from serving import (
    API_KEY,
    CHAT_API_IDLE_CANCEL_S,
    CHAT_API_WINDOW,
    MODEL,
    OTHER_KEY,
    USER,
    chat_body,
    headers,
    sse_events,
    wait_for,
)

from fairway.gateway.cursor import RUN_SPAN

IDLE_CANCEL_S = CHAT_API_IDLE_CANCEL_S
WINDOW = CHAT_API_WINDOW
LONG_REPLY = WINDOW - 100  # tokens: room for a short prompt

# A stable system text, as every deployment has: long enough that one turn's new tokens (the
# reply and the next question) are a small part of the next prompt.
SYSTEM = (
    "You are Fairway's assistant. You answer briefly and precisely. You never invent facts; when you "
    "do not know something you say so. When a question is ambiguous you say which readings you see "
    "and answer the most likely one. You write plain text without markdown unless asked. "
) * 6


@pytest.fixture
def server(chat_api_server):
    return chat_api_server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=headers(), timeout=120) as c:
        yield c


def stored_reply(http: httpx.Client, conversation_id: str, reply_id: str, timeout: float = 30.0) -> dict:
    """The assistant message a reply saved, once it is saved."""

    def find():
        body = http.get(f"/v1/conversations/{conversation_id}").json()
        return next((m for m in body["messages"] if m.get("reply_id") == reply_id), None)

    return wait_for(find, timeout)


# -- the basics ----------------------------------------------------------------------------


def test_health_ready_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["context_window"] == WINDOW


def test_the_sdk_retrieves_a_served_model_and_a_missing_one_is_404(client, http):
    model = client.models.retrieve(MODEL)  # GET /v1/models/{model}
    assert model.id == MODEL and model.object == "model" and model.owned_by == "fairway"
    assert model.model_extra["context_window"] == WINDOW
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert "no-such-model" in err.value.body["message"]
    missing = http.get("/v1/models/org/no-such-model")  # a Hugging Face style id: one id, not a route below
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_sdk_streaming(client, http):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    reply_id = raw.headers["x-reply-id"]
    chunks = list(raw.parse())
    assert all(c.object == "chat.completion.chunk" and c.id == reply_id and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert [c.choices[0].model_extra["checkpoint_id"] for c in content] == [f"tok_{n}" for n in range(1, len(content) + 1)]
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens >= 1 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    # The reply is saved with its text, status and counts.
    message = stored_reply(http, chunks[0].model_extra["conversation_id"], reply_id)
    assert (message["content"], message["status"]) == (text, "complete")
    assert message["usage"]["completion_tokens"] == usage.completion_tokens


def test_sdk_non_streaming_with_content_parts(client):
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"},
                                                 {"type": "text", "text": "Answer with a number."}]}],
    )
    assert completion.object == "chat.completion" and completion.id.startswith("rep_")
    assert completion.choices[0].message.role == "assistant" and completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 5 and completion.usage.prompt_tokens > 10
    assert completion.model_extra["conversation_id"].startswith("conv_")


def test_sse_events_are_numbered(http):
    with http.stream("POST", "/v1/chat/completions", json=chat_body("Name a colour.", max_tokens=5)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1].data == "[DONE]"
    numbered = [e for e in events if e.id is not None]
    assert [e.id for e in numbered] == list(range(1, len(numbered) + 1))
    for e in numbered:
        assert e.data["choices"][0]["checkpoint_id"] == f"tok_{e.id}"
        assert e.data["id"] == e.data["reply_id"] == r.headers["x-reply-id"]
    assert numbered[-1].finish_reason in ("stop", "length")


# -- resume, stop, nobody listening ------------------------------------------------------------


def start_stream(http: httpx.Client, prompt: str, read: int, max_tokens: int = 40, **extra) -> tuple[dict, list]:
    """Open a stream, read `read` numbered events, then drop the connection (like Wi-Fi would)."""
    got = []
    with http.stream("POST", "/v1/chat/completions", json=chat_body(prompt, max_tokens=max_tokens, **extra)) as r:
        assert r.status_code == 200
        for event in sse_events(r):
            got.append(event)
            if len(got) == read:
                break
    return dict(r.headers), got


def test_resume_with_last_event_id_after_a_drop(http):
    head, first = start_stream(http, "Count from one to thirty in words.", read=3)
    reply_id, conversation_id = head["x-reply-id"], head["x-conversation-id"]
    assert [e.id for e in first] == [1, 2, 3]
    # The user's message was stored before generation started.
    stored = http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
    assert stored[0]["role"] == "user" and stored[0]["content"].startswith("Count from one")
    with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "3"}) as r:
        assert r.status_code == 200
        rest = list(sse_events(r))
    assert rest[0].id == 4 and "role" not in rest[0].data["choices"][0]["delta"]
    numbered = [e for e in rest if e.id is not None]
    assert [e.id for e in numbered] == list(range(4, 4 + len(numbered)))  # no gap, no repeat
    text = "".join(e.content for e in first + rest)
    # The drop did not stop the reply: it ran to its end and was saved whole.
    message = stored_reply(http, conversation_id, reply_id)
    assert message["status"] == "complete" and message["content"] == text


def test_resume_by_resending_the_request(http):
    body = {"message_id": "msg-client-7"}
    head, first = start_stream(http, "List five fruits, one per line.", read=2, **body)
    again = chat_body("List five fruits, one per line.", max_tokens=40, last_received_token_index=2, **body)
    with http.stream("POST", "/v1/chat/completions", json=again) as r:
        assert r.status_code == 200 and r.headers["x-reply-id"] == head["x-reply-id"]
        rest = list(sse_events(r))
    assert rest[0].id == 3
    text = "".join(e.content for e in first + rest)
    message = stored_reply(http, head["x-conversation-id"], head["x-reply-id"])
    assert message["content"] == text
    # Re-sending without the index attaches to the same reply from the start: no second reply.
    with http.stream("POST", "/v1/chat/completions", json={**again, "last_received_token_index": None}) as r:
        replay = list(sse_events(r))
    assert r.headers["x-reply-id"] == head["x-reply-id"]
    assert "".join(e.content for e in replay) == text


def test_stop_keeps_the_text_and_says_so(http):
    with http.stream("POST", "/v1/chat/completions",
                     json=chat_body("Write a long story about a dragon.", max_tokens=200)) as r:
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        events = []
        for event in sse_events(r):
            events.append(event)
            if len(events) == 3:
                stop = http.post(f"/v1/replies/{reply_id}/stop")
                assert stop.status_code == 200 and stop.json()["stop_requested"] is True
    final = [e for e in events if e.finish_reason][0]
    assert final.finish_reason == "stop" and final.data["stopped"] is True
    assert final.data["choices"][0]["stopped"] is True
    assert events[-1].data == "[DONE]"
    text = "".join(e.content for e in events)
    message = stored_reply(http, conversation_id, reply_id)
    assert message["status"] == "stopped" and message["content"] == text
    assert message["usage"]["completion_tokens"] < 100
    # Stopping again: it already ended.
    assert http.post(f"/v1/replies/{reply_id}/stop").json()["stop_requested"] is False


def test_a_message_sent_while_the_conversation_is_answering_is_409_until_the_reply_ends(client, http):
    """One turn at a time: a second message to a conversation whose reply is still being written
    would be answered without the first answer, and the history would hold both questions before
    both answers. It is refused (409 conversation_busy, naming the reply) until that reply ends:
    right after its [DONE] the next message goes through."""
    with http.stream("POST", "/v1/chat/completions", json=chat_body(
            "Write a long story about a dragon.", max_tokens=LONG_REPLY, ignore_eos=True)) as r:
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        events = sse_events(r)
        next(events)  # it runs
        with pytest.raises(openai.ConflictError) as busy:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "And?"}],
                                           extra_body={"conversation_id": conversation_id})
        assert (busy.value.code, busy.value.param) == ("conversation_busy", "conversation_id")
        assert busy.value.response.headers["x-reply-id"] == reply_id and reply_id in busy.value.message
        raw = http.post("/v1/chat/completions", json=chat_body("And?", conversation_id=conversation_id))
        assert raw.status_code == 409 and raw.json()["error"]["code"] == "conversation_busy"
        assert http.post(f"/v1/replies/{reply_id}/stop").json()["stop_requested"] is True
        rest = list(events)
    assert rest[-1].data == "[DONE]"
    after = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "And?"}],
                                           extra_body={"conversation_id": conversation_id})
    stored = http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"), ("assistant", "stopped"), ("user", "complete"), ("assistant", "complete")]
    assert stored[1]["reply_id"] == reply_id and stored[3]["reply_id"] == after.id


def test_messages_racing_into_one_conversation_never_interleave(client, http):
    """Four clients send the next message of one conversation at once: each is answered (200) or
    refused as busy (409), and the history stays question, answer, question, answer."""
    first = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi."}])
    conversation_id = first.model_extra["conversation_id"]
    gate = threading.Barrier(4)

    def send(i: int) -> int:
        with httpx.Client(base_url=http.base_url, headers=headers(), timeout=120) as c:
            gate.wait()
            return c.post("/v1/chat/completions", json=chat_body(f"Question {i}?", max_tokens=4, stream=False,
                                                                 conversation_id=conversation_id)).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(send, range(4)))
    assert set(statuses) <= {200, 409} and 200 in statuses, statuses
    stored = http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] * (1 + statuses.count(200))
    assert len({m["content"] for m in stored[2::2]}) == statuses.count(200)


def test_stopping_an_orphaned_reply_frees_its_conversation(server, http):
    """A reply stored but never run (its gateway died between storing the turn and starting it)
    holds its conversation: the next message is 409. Stopping it ends it in the store, and the
    conversation takes the next message."""
    from fairway.conversation import Role
    from fairway.conversation.entities import Conversation, new_id, now
    from fairway.conversation.store import NewTurn

    async def orphan() -> tuple[str, str]:
        ts = now()
        conversation = Conversation(new_id("conv"), USER, "paid", MODEL, "Hello?", ts, ts)
        _, reply = await server.gateway.store.store_turn(NewTurn(conversation, True, [(Role.USER, "Hello?")]))
        return conversation.id, reply.id

    conversation_id, reply_id = server.call(orphan())
    body = chat_body("Anyone there?", stream=False, conversation_id=conversation_id)
    refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 409 and refused.headers["x-reply-id"] == reply_id
    stop = http.post(f"/v1/replies/{reply_id}/stop").json()
    assert (stop["stop_requested"], stop["state"]) == (False, "STOPPED")
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    stored = http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"), ("assistant", "stopped"), ("user", "complete"), ("assistant", "complete")]


def test_reply_nobody_listens_to_is_cancelled(http):
    # ignore_eos and most of the window: the reply outlasts the idle timeout on any CPU (a Zen 5
    # core writes 300 tokens in ~2 s, the timeout itself). Sampled, so that prompt lookup's
    # speculation, which a greedy reply's repetitions feed, does not speed it past the timeout.
    head, _ = start_stream(http, "Write a very long essay about the history of Rome.", read=1,
                           max_tokens=LONG_REPLY, ignore_eos=True, temperature=1.0, seed=7)
    started = time.monotonic()
    message = stored_reply(http, head["x-conversation-id"], head["x-reply-id"], timeout=IDLE_CANCEL_S + 20)
    assert message["status"] == "stopped"
    assert message["usage"]["completion_tokens"] < LONG_REPLY
    assert time.monotonic() - started >= IDLE_CANCEL_S - 0.5
    reply = http.get(f"/v1/replies/{head['x-reply-id']}").json()
    assert reply["state"] == "STOPPED"


def test_a_client_leaving_while_its_reply_is_saved_does_not_cut_the_save(server, http):
    """The stream saves the reply before [DONE]; a client that leaves then (a closed tab) ends the
    stream, not the write. (A save cancelled inside its SQLite transaction left the file locked:
    every later write waited out the 30-s busy timeout and failed.)"""
    import asyncio
    import threading

    store = server.gateway.store
    finish = store.finish_reply
    saving, outcomes = threading.Event(), []

    async def slow_finish(*args, **kwargs):
        saving.set()
        try:
            await asyncio.sleep(0.5)  # the client leaves meanwhile
            result = await finish(*args, **kwargs)
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise
        outcomes.append("saved")
        return result

    store.finish_reply = slow_finish
    try:
        with http.stream("POST", "/v1/chat/completions", json=chat_body("Name a colour.", max_tokens=5)) as r:
            assert r.status_code == 200
            head = dict(r.headers)
            assert saving.wait(30)
        wait_for(lambda: outcomes, timeout=10)
    finally:
        store.finish_reply = finish
    assert outcomes[0] == "saved", outcomes
    message = stored_reply(http, head["x-conversation-id"], head["x-reply-id"])
    assert message["status"] == "complete"
    started = time.monotonic()  # and the next reply is saved at once
    with http.stream("POST", "/v1/chat/completions", json=chat_body("Name a fruit.", max_tokens=5)) as r:
        assert list(sse_events(r))[-1].data == "[DONE]"
    assert time.monotonic() - started < 10


# -- conversations and context -------------------------------------------------------------


def test_five_turns_hit_the_prefix_cache(client):
    """Cache-friendly context: from turn 2 on, >= 90% of each prompt is served from the prefix cache.
    (Turn 1 is too, once another conversation has run with the same system text.)"""
    questions = ["What is the capital of France?", "And of Germany?", "Which of the two is bigger?",
                 "Name a river in each.", "Thanks! Summarise in one line."]
    for attempt in ("warm the system text", "measure"):
        conversation_id = None
        ratios = []
        for question in questions:
            messages = [{"role": "user", "content": question}]
            if conversation_id is None:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            completion = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0,
                extra_body={"conversation_id": conversation_id} if conversation_id else None,
            )
            conversation_id = completion.model_extra["conversation_id"]
            usage = completion.usage
            ratios.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
            if attempt == "measure":
                assert completion.model_extra["context"]["dropped_turns"] == 0
    assert all(r >= 0.9 for r in ratios), ratios


def test_conversation_continues_from_the_store(client, http):
    first = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."}],
    )
    conversation_id = first.model_extra["conversation_id"]
    second = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, messages=[{"role": "user", "content": "What is my name?"}],
        extra_body={"conversation_id": conversation_id},
    )
    assert second.model_extra["conversation_id"] == conversation_id
    # Turn 2's prompt holds turn 1: it is longer than the system text and question alone.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    body = http.get(f"/v1/conversations/{conversation_id}").json()
    assert [(m["role"], m["status"]) for m in body["messages"]] == [
        ("system", "complete"), ("user", "complete"), ("assistant", "complete"),
        ("user", "complete"), ("assistant", "complete")]
    assert body["messages"][2]["content"] == first.choices[0].message.content
    listed = http.get("/v1/conversations", params={"limit": 100}).json()
    assert conversation_id in [c["id"] for c in listed["data"]]
    for before in ("nan", "inf"):  # not a time to page from
        assert http.get("/v1/conversations", params={"before": before}).json()["error"]["param"] == "before"
    # Another user sees none of it.
    other = http.get(f"/v1/conversations/{conversation_id}", headers=headers(OTHER_KEY))
    assert other.status_code == 404
    assert http.delete(f"/v1/conversations/{conversation_id}").json()["deleted"] is True
    assert http.get(f"/v1/conversations/{conversation_id}").status_code == 404
    assert http.delete(f"/v1/conversations/{conversation_id}").status_code == 404


def test_overflow_drops_the_oldest_turns_and_says_so(client):
    long_turn = "Tell me about the sea. " * 45  # ~270 tokens a question
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(3):
        messages += [{"role": "user", "content": f"{i}: {long_turn}"}, {"role": "assistant", "content": "Okay."}]
    messages.append({"role": "user", "content": "Now, in one word: what did we talk about?"})
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0)
    context = completion.model_extra["context"]
    assert context["dropped_turns"] >= 1 and context["dropped_messages"] == 2 * context["dropped_turns"]
    assert completion.usage.prompt_tokens <= WINDOW - 200


# -- bad input -----------------------------------------------------------------------------


def test_context_over_the_window_is_400_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2000}])
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert err.value.param == "messages"


def test_n_above_1_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert err.value.param == "n" and "n=1" in err.value.message


def test_a_temperature_too_small_to_divide_by_is_greedy(client):
    """1e-320 is > 0 but 0 in float32: it made the sampler fail and stopped the engine for everyone."""
    def reply(temperature: float) -> str:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                              max_tokens=4, temperature=temperature).choices[0].message.content

    assert reply(1e-320) == reply(0)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0.7).choices[0].message.content is not None  # still serving


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found"


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "x", "messages": [', 400, None),  # malformed JSON
        (b"[1, 2]", 400, None),
        (b"", 400, None),
        # Half a surrogate pair: valid JSON, but no text (it was a 500: it cannot be hashed or stored).
        (b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}]}' % MODEL.encode(), 400, None),
        ({**GOOD, "messages": []}, 400, "messages"),
        ({"model": MODEL}, 400, "messages"),
        ({**GOOD, "model": 7}, 400, "model"),
        ({**GOOD, "messages": "hi"}, 400, "messages"),
        ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({**GOOD, "messages": [{"role": "tool", "content": "hi"}]}, 400, "messages[0].tool_call_id"),
        ({**GOOD, "messages": [{"role": "function", "content": "hi"}]}, 400, "messages[0].role"),
        ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({**GOOD, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ({**GOOD, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),
        ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "messages[0].content[0].type"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "temperature": 5}, 400, "temperature"),
        ({**GOOD, "top_p": 0}, 400, "top_p"),
        ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": WINDOW}, 400, "messages"),  # nothing left for the prompt
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**GOOD, "seed": "1"}, 400, "seed"),
        ({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400,
         "tools[0].function.parameters"),
        ({**GOOD, "functions": [{"name": "f"}]}, 400, "functions"),  # the legacy form: use tools
        ({**GOOD, "conversation_id": "conv_missing"}, 404, "conversation_id"),
        ({**GOOD, "message_id": "never-sent", "last_received_token_index": 3}, 404, "last_received_token_index"),
        ({**GOOD, "last_received_token_index": 3}, 400, "last_received_token_index"),
        ({**GOOD, "last_received_token_index": -1}, 400, "last_received_token_index"),
        ({**GOOD, "message_id": "m", "last_received_token_index": 2**63}, 400, "last_received_token_index"),
        ({**GOOD, "model": "nope"}, 404, "model"),
    ],
)
def test_bad_chat_requests_get_openai_errors(http, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.post("/v1/chat/completions", headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_body_over_1_mib_is_413(http):
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    response = http.post("/v1/chat/completions", json=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # Without a Content-Length (chunked), the limit holds as the bytes arrive.
    chunks = (b"x" * 65536 for _ in range(20))
    response = http.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    # The same where the framework parses the body into a model (it answers any error reading a
    # body with a 400 of its own): 413.
    for method, path in (("PUT", "/v1/user/memory/settings"), ("POST", "/v1/user/memory/extract")):
        chunks = (b"x" * 65536 for _ in range(20))
        response = http.request(method, path, content=chunks, headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large", path
    # A body that is not JSON there: a 400 saying so, no field named (it was the error's offset).
    response = http.post("/v1/user/memory/extract", content=b"not json", headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None and "not valid JSON" in error["message"]


def test_unknown_replies_conversations_and_event_ids_are_404(http, client):
    assert http.get("/v1/replies/rep_missing/stream").status_code == 404
    assert http.post("/v1/replies/rep_missing/stop").status_code == 404
    assert http.get("/v1/conversations/conv_missing").status_code == 404
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    completion = raw.parse()
    reply_id, last = completion.id, completion.model_extra["last_event_id"]
    past_end = http.get(f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(last + 5)})
    assert past_end.status_code == 404 and past_end.json()["error"]["code"] == "event_id_out_of_range"
    for raw in ("abc", "1e3", str(2**64)):  # (2**64 was a 500 on Redis, past its 64-bit stream ids)
        garbage = http.get(f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": raw})
        assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "Last-Event-ID", raw
    for raw in ("\u00b2", str(10**30)):  # '²' passes str.isdigit() but not int(): it was a 500
        garbage = http.get(f"/v1/replies/{reply_id}/stream", params={"after": raw})
        assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "after", raw
    # Resuming at the very end gives just the end.
    with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(last)}) as r:
        assert [e.data for e in sse_events(r)] == ["[DONE]"]
    # Another user's reply does not exist for them.
    other = http.get(f"/v1/replies/{reply_id}/stream", headers=headers(OTHER_KEY))
    assert other.status_code == 404


# -- after the token log has expired -------------------------------------------------------------


def expire_log(server, reply_id: str) -> None:
    """What 30 minutes of retention do to a reply's log, now."""

    async def drop() -> None:
        server.gateway.token_log._logs.pop(reply_id, None)
        assert not await server.gateway.token_log.exists(reply_id)

    server.call(drop())


def test_a_finished_reply_comes_back_from_the_store(server, client, http):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three birds."}], max_tokens=8, temperature=0)
    reply_id, last = completion.id, completion.model_extra["last_event_id"]
    stored_reply(http, completion.model_extra["conversation_id"], reply_id)
    expire_log(server, reply_id)
    with http.stream("GET", f"/v1/replies/{reply_id}/stream") as r:
        events = list(sse_events(r))
    assert "".join(e.content for e in events) == completion.choices[0].message.content
    assert events[-2].id == last and events[-2].finish_reason == completion.choices[0].finish_reason
    # From a cursor inside the reply the store cannot split tokens: the whole text, marked so.
    with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "2"}) as r:
        events = list(sse_events(r))
    assert events[0].data["snapshot"] is True
    assert events[0].content == completion.choices[0].message.content


def orphan_reply(server, question: str, **sampling) -> tuple[str, str]:
    """A reply stored with its context and marked running on a replica that died, with no token
    log: what a restarted process finds. Its (conversation id, reply id)."""
    from fairway.conversation import Role
    from fairway.conversation.entities import Conversation, new_id, now
    from fairway.conversation.store import NewTurn

    store = server.gateway.store
    prompt = server.gateway.service.tokenizers[MODEL].chat_prompt_ids([{"role": "user", "content": question}])

    async def store_it() -> tuple[str, str]:
        ts = now()
        conversation = Conversation(new_id("conv"), USER, "paid", MODEL, question, ts, ts)
        job = {"model": MODEL, "sampling": {"temperature": 0, **sampling}, "lane": "free"}
        _, reply = await store.store_turn(NewTurn(conversation, True, [(Role.USER, question)],
                                                  prompt_token_ids=prompt, job=job))
        await store.mark_running_many([(reply.id, "a-replica-that-died")])
        return conversation.id, reply.id

    return server.call(store_it())


def test_an_unfinished_reply_is_continued_from_its_stored_context(server, http):
    """Its log expired before it finished (say, the process restarted): the next reader runs it
    again from the context stored with it."""
    conversation_id, reply_id = orphan_reply(server, "Say yes.", max_tokens=4)
    with http.stream("GET", f"/v1/replies/{reply_id}/stream") as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    # Its second run: the ids say so (gateway/cursor.py), so none is mistaken for the lost run's.
    assert [e.id for e in events if e.id] == [RUN_SPAN + n for n in range(1, len(events))]
    assert events[-1].data == "[DONE]" and events[-2].finish_reason in ("stop", "length")
    message = stored_reply(http, conversation_id, reply_id)
    assert message["status"] == "complete" and message["content"] == "".join(e.content for e in events)
    assert message["finish_reason"] == events[-2].finish_reason  # length or stop: the status does not say
    assert http.get(f"/v1/replies/{reply_id}").json()["last_event_id"] == events[-2].id


def test_a_reply_whose_log_was_lost_runs_again_with_nobody_reading_it(server, http):
    """After a restart of the process that held its token log, a reply nobody comes back to read
    would stay running, and its conversation take no new message (409) for good: the gateway's
    sweep runs it again, it ends, and the conversation goes on."""
    service = server.gateway.service
    conversation_id, reply_id = orphan_reply(server, "Say yes.", max_tokens=4)
    busy = http.post("/v1/chat/completions", json=chat_body("And?", stream=False, conversation_id=conversation_id))
    assert busy.status_code == 409 and busy.headers["X-Reply-Id"] == reply_id
    restarted, unplaced = server.call(service.restart_lost(min_age_s=0.0))
    assert (restarted, unplaced) == (1, 0)
    assert server.call(service.restart_lost(min_age_s=0.0)) == (0, 0)  # its log is back: once is enough
    assert stored_reply(http, conversation_id, reply_id)["status"] == "complete"
    answer = http.post("/v1/chat/completions", json=chat_body("And?", stream=False, conversation_id=conversation_id))
    assert answer.status_code == 200, answer.text

    # One stored longer ago than a log lives (here: logs that live no time at all) is stopped,
    # with no text, rather than run again: nobody waits for it any more.
    conversation_id, reply_id = orphan_reply(server, "Say yes.", max_tokens=4)
    log = service.relay.log
    ttl_s, log.ttl_s = log.ttl_s, 0.0
    try:
        assert server.call(service.restart_lost(min_age_s=0.0)) == (0, 0)
    finally:
        log.ttl_s = ttl_s
    stopped = http.get(f"/v1/replies/{reply_id}").json()
    assert stopped["state"] == "STOPPED" and stored_reply(http, conversation_id, reply_id)["content"] == ""


def test_a_client_of_a_lost_run_gets_the_new_run_from_its_start(server, http):
    """A client that had the first words of a reply whose log was then lost (the process
    restarted) comes back with its Last-Event-ID: the reply runs again from its stored context,
    and the client is told to drop its text (an empty snapshot) and gets the new run whole, not
    the new run's words past its old id spliced onto the old ones. A second client with an id of
    the lost run, after the restart, is told the same; one with an id of the new run carries on."""
    _, reply_id = orphan_reply(server, "Count to ten.", max_tokens=24, ignore_eos=True)

    def resumed(last_event_id: int) -> list:
        with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(last_event_id)}) as r:
            assert r.status_code == 200
            return list(sse_events(r))

    first = resumed(7)  # seven events of the lost run: the client shows their text
    assert first[0].data["snapshot"] is True and first[0].content == "" and first[0].id == RUN_SPAN
    new_run = first[1:-1]
    assert [e.id for e in new_run] == [RUN_SPAN + n for n in range(1, len(new_run) + 1)]
    text = "".join(e.content for e in new_run)
    assert len(text) > 10 and new_run[-1].finish_reason == "length"
    again = resumed(12)  # another tab, further into the lost run
    assert again[0].data["snapshot"] is True and again[0].content == text
    later = resumed(RUN_SPAN + 3)  # a client of the new run: the events after its own
    assert "".join(e.content for e in later) == "".join(e.content for e in new_run[3:])
    assert http.get(f"/v1/replies/{reply_id}/stream",
                    headers={"Last-Event-ID": str(2 * RUN_SPAN + 1)}).status_code == 404


# -- guided decoding: what the real model writes, held to a schema ---------------------------------

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["city", "population"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather now.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string", "maxLength": 24}},
                                                     "required": ["city"], "additionalProperties": False}}}


def test_sdk_response_format_json_schema(client):
    import json

    import jsonschema

    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A big city and its population?"}], max_tokens=60,
        temperature=1.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY_SCHEMA)
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_sdk_tool_choice_forces_a_call_that_fits(client, choice):
    import json

    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=60, temperature=1.0, seed=3,
        tools=[WEATHER_TOOL], tool_choice=choice)
    choice_out = answer.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    (call,) = choice_out.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_a_schema_llguidance_cannot_use_is_a_400(http):
    bad = {**chat_body("hi", stream=False), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}
    response = http.post("/v1/chat/completions", json=bad)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize(("max_tokens", "stream"), [(10, False), (3, False), (10, True)])
def test_sdk_a_forced_call_cut_off_by_max_tokens_is_no_text(client, http, max_tokens, stream):
    """A forced call that max_tokens cuts off ends with finish_reason length and neither a call nor
    its markup: it was shown as content ('<tool_call>\\n{"name": "') and stored, so the next prompt
    held it too."""
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}], max_tokens=max_tokens,
        tools=[WEATHER_TOOL], tool_choice="required", stream=stream)
    if stream:
        chunks = [c for c in answer if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish, conversation_id = chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["conversation_id"]
    else:
        message = answer.choices[0].message
        content, calls, finish = message.content, message.tool_calls or [], answer.choices[0].finish_reason
        conversation_id = answer.model_extra["conversation_id"]
    assert (content or "", calls, finish) == ("", [], "length")
    stored = wait_for(lambda: [m for m in http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
                               if m["role"] == "assistant"])
    assert stored[0]["content"] == "" and not stored[0].get("tool_calls")


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "system", "content": [{"type": "file_url", "file_id": "file-abc"}]}, {"role": "user", "content": "hi"}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Here:"}, {"type": "file", "file": {"file_id": "file-abc"}}]},
      {"role": "user", "content": "thanks"}], "messages[1].content[1].type"),
    ([{"role": "developer", "content": [{"type": "input_file", "file_id": "file-abc"}]},
      {"role": "user", "content": "hi"}], "messages[0].content[0].type"),
])
def test_sdk_a_file_part_outside_a_user_message_is_a_400(client, messages, param):
    """Only a user message attaches files; a file part elsewhere was neither attached nor refused
    (dropped in silence, the reply answering as if it had read the file)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_content_type",
                                                              "invalid_request_error"), error
    assert "attach files in a user message" in error["message"]
