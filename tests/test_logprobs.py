"""logprobs and top_logprobs through the chat API, as an OpenAI SDK user asks for them: `fairway
serve`'s app (bundled model on the CPU) over real HTTP, the one test_api.py uses (conftest's
chat_api_server), streamed and not, resumed with Last-Event-ID; the values against the model's own
distribution; bad values are 400s naming the param. And the token log's events carrying them, on
the in-process log, Redis and a Redis Cluster."""

from __future__ import annotations

import asyncio
import math
from contextlib import aclosing

import httpx
import openai
import pytest
import test_relay as relay_tests
from next_token import next_token_probs
from serving import MODEL, chat_body, headers, sse_events

from fairway.relay import FinalEvent, ReplyState, TokenEvent, TokenLogprob, event_from_fields

QUESTION = [{"role": "user", "content": "Name three fruits."}]
TOP = 5
# nats: the server's decode steps against one forward pass over the context, both with bf16 logits
# (a logit near 16 is 0.125 from its neighbours)
TOLERANCE = 0.15


def check_tokens(content, top: int, greedy: bool = True) -> None:
    """What holds of every token's logprobs: at most 0, the top list sorted best first and of the
    asked length, its mass at most 1; greedy: the token is the top one, its logprob the largest."""
    assert content
    for token in content:
        assert token.logprob <= 0
        assert bytes(token.bytes).decode("utf-8", errors="replace") == token.token
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == top
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        if greedy and top:  # (bf16 logits tie often: the token is one of the best, maybe not the first listed)
            assert token.top_logprobs[0].logprob == token.logprob == max(values)
            assert token.token in [t.token for t in token.top_logprobs if t.logprob == token.logprob]


def text_of(content) -> str:
    return b"".join(bytes(t.bytes) for t in content).decode(errors="replace")


def test_a_greedy_reply_has_its_tokens_logprobs(chat_api_sdk):
    response = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=TOP)
    choice = response.choices[0]
    content = choice.logprobs.content
    check_tokens(content, TOP)
    assert text_of(content) == choice.message.content  # one entry per token of the reply, in order
    assert choice.logprobs.refusal is None


def served_model(chat_api_server):
    """The model the server's replica runs (its engine's, reached through the replica's start hook)."""
    (worker,) = [hook.__self__ for hook in chat_api_server.gateway.on_startup if type(getattr(hook, "__self__", None)).__name__
                 == "ReplicaWorker"]
    return worker.engine.engine.model


def test_the_logprobs_are_the_models_distribution(chat_api_server, chat_api_sdk, chat_api_tokenizer):
    response = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    prompt = chat_api_tokenizer.chat_prompt_ids(QUESTION)
    assert response.usage.prompt_tokens == len(prompt)  # (nothing added to the context: a fresh conversation)
    ids = {chat_api_tokenizer.token_bytes(i): i for i in range(chat_api_tokenizer.vocab_size)}  # a token's bytes name it
    model, context = served_model(chat_api_server), list(prompt)
    for token in response.choices[0].logprobs.content:
        probs = next_token_probs(model, context, 1.0)  # one forward pass over the whole context
        for entry in (token, *token.top_logprobs):
            assert entry.logprob == pytest.approx(math.log(probs[ids[bytes(entry.bytes)]]), abs=TOLERANCE)
        context.append(ids[bytes(token.bytes)])


def test_logprobs_without_top_logprobs_give_an_empty_top_list_and_a_sampled_reply_has_them(chat_api_sdk):
    response = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.9,
                                              seed=3, logprobs=True)
    check_tokens(response.choices[0].logprobs.content, 0, greedy=False)
    plain = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None  # not asked: none


def test_a_streamed_reply_carries_each_chunks_logprobs(chat_api_sdk):
    chunks = list(chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    content, text = [], ""
    for piece in chunks:
        if not piece.choices:
            continue
        choice = piece.choices[0]
        if choice.finish_reason is None:
            assert len(choice.logprobs.content) == 1  # a chunk's one token (its text may wait for the next's)
            content += choice.logprobs.content
        else:
            assert choice.logprobs is None
        text += choice.delta.content or ""
    check_tokens(content, 2)
    assert text_of(content) == text
    whole = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert [(t.token, t.logprob) for t in whole.choices[0].logprobs.content] == [(t.token, t.logprob)
                                                                               for t in content]


def token_events(events: list) -> list:
    return [e for e in events if isinstance(e.data, dict) and e.data.get("choices")
            and e.data["choices"][0]["finish_reason"] is None]


def test_a_resumed_stream_still_has_its_logprobs(chat_api_server):
    body = chat_body("Name three fruits.", max_tokens=10, temperature=0, logprobs=True, top_logprobs=1)
    with httpx.Client(base_url=chat_api_server.url, headers=headers(), timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = list(sse_events(response))
        reply_id = response.headers["x-reply-id"]
        tokens = token_events(events)
        assert len(tokens) > 3
        with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "2"}) as response:
            resumed = list(sse_events(response))
    again = token_events(resumed)
    assert [e.data["choices"][0]["logprobs"] for e in again] == [e.data["choices"][0]["logprobs"] for e in tokens[2:]]
    assert all(e.data["choices"][0]["logprobs"]["content"][0]["top_logprobs"] for e in again)


def test_logprobs_hold_with_a_grammar_and_with_tools(chat_api_sdk):
    response = chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=2, response_format={"type": "json_object"})
    content = response.choices[0].logprobs.content
    # The grammar's mask comes after the raw logprobs: a token need not be the model's first choice.
    check_tokens(content, 2, greedy=False)
    assert text_of(content) == response.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    response = chat_api_sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=40,
        temperature=0, logprobs=True, tools=tools, tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.logprobs.content == []  # the call's tokens are no content: no logprobs for them


def test_top_logprobs_without_logprobs_is_a_400_naming_it(chat_api_sdk):
    for extra in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False}, {"top_logprobs": 0}):
        with pytest.raises(openai.BadRequestError) as err:
            chat_api_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **extra)
        assert err.value.param == "top_logprobs" and err.value.code == "invalid_value"


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
])
def test_bad_values_are_400s_in_openais_shape(chat_api_server, extra, param):
    response = httpx.post(f"{chat_api_server.url}/v1/chat/completions", json=chat_body("hi", stream=False, **extra),
                          headers=headers(), timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"


# -- the token log ----------------------------------------------------------------------------

LOGPROBS = [TokenLogprob("é", -0.25, [195, 169], [TokenLogprob("é", -0.25, [195, 169]),
                                                  TokenLogprob("\ufffd", -2.5, [195])])]


def test_an_event_without_logprobs_still_parses():
    old = {"k": "t", "n": "3", "text": "hi", "ids": "5"}
    assert event_from_fields(old) == TokenEvent(3, "hi", [5])
    event = TokenEvent(4, "é", [17], LOGPROBS)
    assert event_from_fields(event.to_fields()) == event


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request):
    url = request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else None
    b = await relay_tests._started(request.param, url)
    yield b
    await b.cleanup()


async def test_the_token_log_carries_logprobs_logged_and_live(backend):
    gateway, replica, reply = backend.log(), backend.log(), relay_tests.rid()
    await gateway.create(reply)

    async def listen() -> list:
        async with aclosing(gateway.subscribe(reply, 0)) as events:
            return [event async for event in events]

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0.05)
    sent = [TokenEvent(1, "é", [17], LOGPROBS), TokenEvent(2, " plain", [9])]
    for event in sent:
        await replica.append(reply, event)
    await replica.finish(reply, FinalEvent(0, "stop", ReplyState.FINISHED))
    live = await asyncio.wait_for(listener, 5)
    logged = await backend.log().read(reply)
    assert live[:2] == sent and logged[:2] == sent


# -- with the output check ----------------------------------------------------------------------

@pytest.fixture
def checked_server(safety_api_server):
    return safety_api_server  # conftest's: the output check on, test_safety_api.py's policy


def test_the_output_check_releases_each_sentences_logprobs_with_it(checked_server):
    body = chat_body("Tell me about cats.", max_tokens=300, logprobs=True)
    with httpx.Client(base_url=checked_server.url, headers=headers(), timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = list(sse_events(response))
    assert next(e for e in events if e.finish_reason).finish_reason == "content_filter"
    tokens = token_events(events)
    text = "".join(e.content for e in tokens)
    assert text.startswith("Cats are")  # the first sentence, which passed
    released = [t for e in tokens for t in e.data["choices"][0]["logprobs"]["content"]]
    assert b"".join(bytes(t["bytes"]) for t in released).decode() == text  # no token of the flagged sentence
    assert all(t["logprob"] <= 0 and t["top_logprobs"] == [] for t in released)
