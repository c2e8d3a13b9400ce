"""Function calling and the execute_code loop, end to end: the real embedded server (gateway,
relay, replica worker, store), the real sandbox and the OpenAI SDK, with a scripted engine in the
model's place (tests/scripted_engine.py) so the model's calls are deterministic.

Also the parser on its own (the two call forms, split anywhere, never leaking a half call) and
the request checks (clear 400s)."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from fairway.relay import FinalEvent, TokenEvent, ToolEvent, make_relay
from fairway.tools import ToolError, parse_tools
from fairway.tools.parser import CallParser
from tests.backends import missing
from tests.scripted_engine import ScriptedEngine
from tests.serving import API_KEY, MODEL, TEST_KEYS, chat_body, embedded_server, headers, sse_events

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CODE = {"type": "code_interpreter"}
BEFORE_CALL = "Let me compute that. "
COMPUTE_CALL = '<tool_call name="execute_code">\nprint(6 * 7)\n</tool_call>'
THREAT = "I will kill you."  # the bundled policy flags it (harassment/threatening, violence)


def script(prompt: str) -> str:
    """The scripted model: it reads the prompt as a model would and answers deterministically."""
    turn = prompt[prompt.rindex("<|im_start|>user"):]
    if "loop forever" in prompt:
        return 'Again.<tool_call name="execute_code">\nprint("round")\n</tool_call>'
    if "<tool_response>" in turn:
        result = turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        if len(result) > 1000:
            return f"It printed {result.count('x')} x, then: {result.splitlines()[-1]}"
        return f"The result is {result}."
    if "print a lot" in turn:
        return 'Sure. <tool_call name="execute_code">\nprint("x" * 10000)\n</tool_call>'
    if "two cities" in turn and "get_weather" in prompt:
        return "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>\n'
                       for city in ("Paris", "Rome"))
    if "weather" in turn and "get_weather" in prompt:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    if "print a threat" in turn:  # the code passes the output check; what it prints does not
        return f'Sure. <tool_call name="execute_code">\nprint("".join(reversed({THREAT[::-1]!r})))\n</tool_call>'
    if "threatening code" in turn:
        return f'Sure. <tool_call name="execute_code">\nprint("{THREAT}")\n</tool_call>'
    if "compute" in turn:
        return BEFORE_CALL + COMPUTE_CALL + " and text after the call, never generated"
    return "Hello there."


# -- the parser ------------------------------------------------------------------------------

def _parse_in_pieces(text: str, seed: int) -> tuple[str, list]:
    rng = random.Random(seed)
    parser, released, calls, i = CallParser(), [], [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        out, done = parser.feed(text[i:i + k])
        released.append(out)
        calls += done
        i += k
    out, done = parser.finish()
    return "".join(released) + out, calls + done


@pytest.mark.parametrize("seed", range(20))
def test_parser_both_forms_split_anywhere(seed):
    text = ('Hi <b>x</b> <tool_call name="execute_code">\n```python\nprint(6 * 7)\n```\n</tool_call> then '
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> <tool_calls> end <tool_')
    released, calls = _parse_in_pieces(text, seed)
    assert released == "Hi <b>x</b>  then  <tool_calls> end <tool_"
    assert [(c.name, json.loads(c.arguments), c.error) for c in calls] == [
        ("execute_code", {"code": "print(6 * 7)"}, None), ("get_weather", {"city": "Paris"}, None)]


def test_parser_holds_a_call_until_it_is_whole():
    parser = CallParser()
    assert parser.feed("The answer: <tool") == ("The answer: ", [])
    assert parser.feed('_call>{"name": "f", "argu') == ("", [])
    assert parser.buffering
    out, calls = parser.feed('ments": {"a": 1}}</tool_call>!')
    assert out == "!" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}


def test_parser_bad_calls_and_an_unclosed_one():
    _, calls = _parse_in_pieces("<tool_call>{not json}</tool_call><tool_call name=\"f\">[1]</tool_call>", 0)
    assert [c.error is not None for c in calls] == [True, True]
    # A model that stops right after its arguments: the call counts; an unparseable open one is
    # dropped, never text (README: no half-written call reaches the client).
    assert _parse_in_pieces('<tool_call>{"name": "f", "arguments": {}}', 1)[1][0].name == "f"
    assert _parse_in_pieces("Hm. <tool_call> oops", 1) == ("Hm. ", [])


def test_parser_drops_a_call_cut_off_by_max_tokens():
    for text in ('Let me check. <tool_call>\n{"name": "', "Let me check. <tool_call", "Let me check. <tool_"):
        parser = CallParser()
        released, calls = parser.feed(text)
        assert parser.finish(cut=True) == ("", []) and released == "Let me check. " and not calls, text
    # Where the model stopped by itself, what only may begin a tag was text.
    parser = CallParser()
    assert parser.feed("See <tool_") == ("See ", []) and parser.finish() == ("<tool_", [])


def test_tool_specs_are_checked():
    tools = parse_tools([WEATHER, CODE], {"type": "function", "function": {"name": "get_weather"}})
    assert tools is not None and tools.code and tools.named == "get_weather"
    assert parse_tools([WEATHER], "none") is None and parse_tools(None, None) is None
    for bad_tools, choice, param in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
         "tools[0].function.parameters.type"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([WEATHER, WEATHER], None, "tools"),
        ([], "required", "tool_choice"),
    ]:
        with pytest.raises(ToolError) as caught:
            parse_tools(bad_tools, choice)
        assert caught.value.param == param


@pytest.mark.parametrize("url", [None, "redis://127.0.0.1:6379/0"])
async def test_tool_events_in_both_token_logs(url):
    relay = make_relay(url)
    try:
        try:
            await relay.ping()
        except Exception as exc:  # noqa: BLE001
            missing("Redis", str(exc))
        reply = f"tools-{random.getrandbits(48)}"
        await relay.log.create(reply)
        await relay.log.append(reply, TokenEvent(1, "a"))
        await relay.log.append(reply, ToolEvent(2, "call_1", "execute_code", "running", '{"code": "1"}'))
        await relay.log.append(reply, ToolEvent(3, "call_1", "execute_code", "completed", '{"code": "1"}',
                                                output="1", detail={"stdout": "1\n", "exit_code": 0}))
        await relay.log.finish(reply, FinalEvent(4, "stop", "FINISHED"))
        events = [e async for e in relay.log.subscribe(reply)]
    finally:
        await relay.close()
    assert [type(e).__name__ for e in events] == ["TokenEvent", "ToolEvent", "ToolEvent", "FinalEvent"]
    assert events[2].detail == {"stdout": "1\n", "exit_code": 0} and events[2].output == "1"


# -- end to end ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from fairway.assembly import ServerOptions, load_tokenizer
    from fairway.sandbox import LocalSandbox

    if (reason := LocalSandbox().static_check()) is not None:
        missing("bubblewrap", reason)
    engine = ScriptedEngine(load_tokenizer(None), script)
    db = tmp_path_factory.mktemp("tools") / "fairway.db"
    options = ServerOptions(database=f"sqlite:///{db}", api_keys=list(TEST_KEYS), memory=False)
    with embedded_server(options, engine) as server:
        server.engine = engine
        yield server


@pytest.fixture
def http(scripted):
    with httpx.Client(base_url=scripted.url, headers=headers(), timeout=60) as client:
        yield client


@pytest.fixture
def sdk(scripted):
    return openai.OpenAI(base_url=f"{scripted.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _stream(http: httpx.Client, body: dict, **kwargs) -> list:
    with http.stream("POST", "/v1/chat/completions", json=body, **kwargs) as response:
        assert response.status_code == 200, response.read()
        return list(sse_events(response))


def _executions(events: list) -> list[dict]:
    return [e.data["tool_execution"] for e in events if isinstance(e.data, dict) and "tool_execution" in e.data]


def test_execute_code_inside_one_reply(scripted, http):
    body = chat_body("Please compute 6 times 7.", max_tokens=200, tools=[CODE])
    events = _stream(http, body)
    ids = [e.id for e in events if e.id is not None]
    assert ids == list(range(1, len(ids) + 1))  # one reply: the ids carry on through the pause
    running, done = _executions(events)
    assert (running["name"], running["status"], running["code"]) == ("execute_code", "running", "print(6 * 7)")
    assert (done["status"], done["output"], done["result"]["stdout"], done["result"]["exit_code"]) == \
        ("completed", "42", "42\n", 0)
    content = "".join(e.content for e in events)
    assert content == BEFORE_CALL + "The result is 42."  # the call itself is never shown as text
    assert events[-2].finish_reason == "stop" and events[-1].data == "[DONE]"
    # The pause event comes after the text before the call and before the text after it.
    kinds = ["tool" if isinstance(e.data, dict) and "tool_execution" in e.data else "text" if e.content else "-"
             for e in events]
    assert kinds.index("tool") > kinds.index("text") and "text" in kinds[kinds.index("tool") + 2:]

    # The reply went on as a continuation on the same engine: the second request's prompt is the
    # first one, the tokens generated up to the call's end, then the result.
    reply_id = events[0].data["reply_id"]
    (first_id, first), (second_id, second) = [p for p in scripted.engine.prompts if p[0].startswith(reply_id)]
    assert (first_id, second_id) == (reply_id, f"{reply_id}#1")
    assert second[:len(first)] == first
    tokenizer = scripted.engine.tokenizer
    continued = tokenizer.decode(second[len(first):])
    assert continued.startswith(BEFORE_CALL + COMPUTE_CALL) and "<tool_response>\n42\n</tool_response>" in continued

    # Stored with the conversation: the text, and the call with its code and output where it was made.
    conversation = http.get(f"/v1/conversations/{events[0].data['conversation_id']}").json()
    assistant = conversation["messages"][-1]
    assert assistant["content"] == content
    (run,) = assistant["tool_executions"]
    assert (run["name"], run["status"], run["output"], run["at"]) == ("execute_code", "completed", "42",
                                                                      len(BEFORE_CALL))
    assert json.loads(run["arguments"]) == {"code": "print(6 * 7)"}

    # A reconnect replays from where it dropped: the pause and the result included.
    pause_n = next(e.id for e in events if isinstance(e.data, dict) and "tool_execution" in e.data)
    with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(pause_n - 1)}) as r:
        replay = list(sse_events(r))
    assert [e.id for e in replay if e.id is not None] == ids[pause_n - 1:]
    assert [x["status"] for x in _executions(replay)] == ["running", "completed"]
    assert "".join(e.content for e in replay) == "The result is 42."


@pytest.mark.parametrize(("ask", "runs"), [("print a threat", ["running", "failed"]), ("threatening code", [])],
                         ids=["output", "code"])
def test_a_tool_call_and_its_output_pass_the_output_check(http, ask, runs):
    """What a tool prints reaches the client only through the output check, like the reply's text;
    so does the code the model wrote (shown in the running event)."""
    events = _stream(http, chat_body(ask, max_tokens=200, tools=[CODE]))
    executions = _executions(events)
    assert [x["status"] for x in executions] == runs
    if runs:
        assert "withheld" in executions[-1]["output"] and "violence" in executions[-1]["result"]["flagged"]
    assert "kill" not in json.dumps([e.data for e in events]).lower()  # nothing flagged reached the client
    assert events[-2].finish_reason == "content_filter" and events[-1].data == "[DONE]"
    assert "".join(e.content for e in events) == "Sure. "
    stored = http.get(f"/v1/conversations/{events[0].data['conversation_id']}").json()["messages"][-1]
    assert stored["status"] == "flagged" and "kill" not in json.dumps(stored).lower()


async def test_a_run_interrupted_by_a_failover_runs_again_under_its_call_id():
    """The replica died while the code ran: its log has the running event and no outcome. The
    replica that carries the reply on runs that call again (the code's runs leave nothing behind to
    repeat) under the same call id, so the client sees one call go from running to completed, and
    the model goes on after its result instead of being asked to call again."""
    from fairway.assembly import load_tokenizer
    from fairway.domain import Lane
    from fairway.engine import AsyncEngine
    from fairway.replica.job import GenerationJob
    from fairway.replica.registry import InProcessRegistry
    from fairway.replica.worker import ReplicaSettings, ReplicaWorker
    from fairway.sandbox import LocalSandbox
    from fairway.tools.prompt import system_block

    if (reason := LocalSandbox().static_check()) is not None:
        missing("bubblewrap", reason)
    tokenizer = load_tokenizer(None)
    engine = ScriptedEngine(tokenizer, script)
    relay = make_relay(None)
    worker = ReplicaWorker(AsyncEngine(engine), relay, InProcessRegistry(), ReplicaSettings(model=MODEL),
                           sandbox=LocalSandbox())
    await worker.start()
    try:
        tools = parse_tools([CODE], "auto")
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": system_block(tools)},
             {"role": "user", "content": "Please compute 6 times 7."}], add_generation_prompt=True))
        before = tokenizer.encode(BEFORE_CALL)
        await relay.log.create("handed")
        for i, token in enumerate(before, 1):
            await relay.log.append("handed", TokenEvent(i, tokenizer.decode([token]), [token]))
        arguments = json.dumps({"code": "print(6 * 7)"})
        await relay.log.append("handed", ToolEvent(len(before) + 1, "call_before", "execute_code", "running",
                                                   arguments))
        job = GenerationJob("handed", MODEL, prompt, {"temperature": 0, "max_tokens": 200}, Lane.PAID.value,
                            tools={**tools.to_dict(), "max_rounds": 5}, attempt=1)
        assert await worker.serve(job) is True
        events = await relay.log.read("handed")
    finally:
        await worker.stop()
        worker.engine.shutdown()
    assert [e.n for e in events] == list(range(1, len(events) + 1))
    calls = [(e.call_id, str(e.status), e.output) for e in events if isinstance(e, ToolEvent)]
    assert calls == [("call_before", "running", ""), ("call_before", "completed", "42")]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text == BEFORE_CALL + "The result is 42."
    (request_id, continued), = engine.prompts  # one engine request: after the result, not before the call
    assert request_id == "handed" and "<tool_response>\n42\n</tool_response>" in tokenizer.decode(continued)
    assert isinstance(events[-1], FinalEvent) and events[-1].finish_reason == "stop"


def test_after_its_log_expired_a_reply_replays_its_tool_runs_from_the_store(scripted, http):
    events = _stream(http, chat_body("Please compute 6 times 7, once more.", max_tokens=200, tools=[CODE]))
    reply_id = events[0].data["reply_id"]
    http.get(f"/v1/conversations/{events[0].data['conversation_id']}")  # (saved before [DONE])

    async def expire() -> None:  # what the log's retention does, now
        scripted.gateway.token_log._logs.pop(reply_id, None)

    scripted.call(expire())
    with http.stream("GET", f"/v1/replies/{reply_id}/stream") as r:
        replay = list(sse_events(r))
    ids = [e.id for e in replay if e.id is not None]
    assert ids == sorted(set(ids)) and ids[-1] == events[-2].id  # increasing, ending where the log ended
    assert [(x["status"], x.get("output")) for x in _executions(replay)] == [("running", None), ("completed", "42")]
    assert "".join(e.content for e in replay) == "".join(e.content for e in events) == BEFORE_CALL + "The result is 42."
    kinds = ["tool" if isinstance(e.data, dict) and "tool_execution" in e.data else "text" if e.content else "-"
             for e in replay]
    assert kinds.index("tool") > kinds.index("text") and "text" in kinds[kinds.index("tool") + 2:]  # in place
    # From a cursor inside the reply: the whole text as a snapshot, and each run's outcome.
    with http.stream("GET", f"/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "2"}) as r:
        resumed = list(sse_events(r))
    assert resumed[0].data["snapshot"] is True and resumed[0].content == BEFORE_CALL + "The result is 42."
    assert [(x["status"], x["output"]) for x in _executions(resumed)] == [("completed", "42")]
    assert all(e.id > 2 for e in resumed if e.id is not None)
    # Read again from the store, the stored message keeps its run.
    conversation = http.get(f"/v1/conversations/{events[0].data['conversation_id']}").json()
    assert [r["output"] for r in conversation["messages"][-1]["tool_executions"]] == ["42"]


def test_a_long_output_is_cut_for_the_model_and_the_client(http):
    from fairway.tools.loop import OUTPUT_CHARS

    events = _stream(http, chat_body("print a lot, please", max_tokens=200, tools=[CODE]))
    _, done = _executions(events)
    cut = "x" * OUTPUT_CHARS + f"\n... ({10_001 - OUTPUT_CHARS} more characters)"
    assert (done["status"], done["output"], done["result"]["stdout"]) == ("completed", cut, cut)
    # The model read the cut output (the scripted model counts what it was given).
    assert "".join(e.content for e in events) == f"Sure. It printed {OUTPUT_CHARS} x, then: {cut.splitlines()[-1]}"


def test_execute_code_without_streaming(http):
    answer = http.post("/v1/chat/completions", json=chat_body("compute it", max_tokens=200, stream=False,
                                                              tools=[CODE])).json()
    message = answer["choices"][0]["message"]
    assert message["content"] == BEFORE_CALL + "The result is 42."
    assert [(t["name"], t["status"], t["output"]) for t in message["tool_executions"]] == \
        [("execute_code", "completed", "42")]
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_a_run_reads_the_same_streamed_stored_or_not(http):
    """A run's fields have one name everywhere: the streamed chunk's (README's) `result` for what
    the sandbox reported, and `code`; the non-streamed message and the stored one said `detail`."""
    body = chat_body("compute it", max_tokens=200, tools=[CODE])
    streamed = _executions(_stream(http, body))[-1]
    answer = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    (run,) = answer["choices"][0]["message"]["tool_executions"]
    (stored,) = http.get(f"/v1/conversations/{answer['conversation_id']}").json()["messages"][-1]["tool_executions"]
    for shown in (streamed, run, stored):
        assert "detail" not in shown and set(streamed) <= set(shown), shown
        assert (shown["status"], shown["code"], shown["output"], shown["result"]["stdout"],
                shown["result"]["exit_code"]) == ("completed", "print(6 * 7)", "42", "42\n", 0)


def test_a_bound_on_tool_rounds(scripted, http):
    events = _stream(http, chat_body("loop forever", max_tokens=500, tools=[CODE]))
    assert [x["status"] for x in _executions(events)] == ["running", "completed"] * 5  # the default bound
    content = "".join(e.content for e in events)
    assert content.endswith("(This reply reached its limit of 5 tool runs, so it ends here.)")
    assert events[-2].finish_reason == "stop"
    scripted.gateway.service.settings.max_tool_rounds = 2  # --max-tool-rounds
    try:
        events = _stream(http, chat_body("loop forever, again", max_tokens=500, tools=[CODE]))
    finally:
        scripted.gateway.service.settings.max_tool_rounds = 5
    assert [x["status"] for x in _executions(events)] == ["running", "completed"] * 2
    assert "".join(e.content for e in events).endswith("limit of 2 tool runs, so it ends here.)")


def test_sdk_client_tool_calls_and_the_follow_up(sdk):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    follow = sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=100, messages=[
        *question, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].finish_reason == "stop"
    assert follow.choices[0].message.content == "The result is sunny, 21 C."


def test_sdk_streamed_tool_calls(sdk):
    stream = sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=100, stream=True,
                                         messages=[{"role": "user", "content": "weather in Paris, please"}])
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(d.content or "" for d in deltas) == ""  # nothing of the call leaked as text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The SDK's own accumulating stream reads the same.
    with sdk.chat.completions.stream(model=MODEL, tools=[WEATHER], max_tokens=100,
                                     messages=[{"role": "user", "content": "weather in Paris, please"}]) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_parallel_tool_calls_false_holds_the_reply_to_one_call(sdk, scripted):
    question = [{"role": "user", "content": "The weather in two cities, Paris and Rome?"}]
    both = sdk.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], max_tokens=100)
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    for stream in (False, True):
        one = sdk.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], max_tokens=100,
                                          parallel_tool_calls=False, stream=stream)
        if stream:
            chunks = list(one)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            calls, finish = one.choices[0].message.tool_calls, one.choices[0].finish_reason
        assert finish == "tool_calls" and [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris"]
    # The model is told so too (a template without tool support: the system block).
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1][1])
    assert "Call at most one function in your reply." in prompt


def test_a_follow_up_in_a_stored_conversation(http, scripted):
    asked = len(scripted.engine.prompts)
    first = http.post("/v1/chat/completions", json=chat_body("weather?", stream=False, max_tokens=100,
                                                             tools=[WEATHER])).json()
    (call,) = first["choices"][0]["message"]["tool_calls"]
    follow = http.post("/v1/chat/completions", json={
        "model": MODEL, "conversation_id": first["conversation_id"], "tools": [WEATHER], "max_tokens": 100,
        "messages": [{"role": "tool", "tool_call_id": call["id"], "content": "rain"}]}).json()
    assert follow["choices"][0]["message"]["content"] == "The result is rain."
    stored = http.get(f"/v1/conversations/{first['conversation_id']}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["id"] == call["id"] and stored[2]["tool_call_id"] == call["id"]
    # Cache-friendly: the follow-up's prompt is the first one, then the call as the model wrote it,
    # then the result, so the prefix cache holds all but the result and the new turn's start.
    (_, before), (_, after) = scripted.engine.prompts[asked:]
    assert after[:len(before)] == before
    tokenizer = scripted.engine.tokenizer
    assert tokenizer.decode(after[len(before):]).startswith(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_a_tool_result_must_answer_a_call_waiting_for_it(http, sdk):
    """OpenAI's rule: a tool message answers a call of the assistant message before it, once. A
    result for no call (or a second one) was stored and went into every later prompt."""
    first = http.post("/v1/chat/completions", json=chat_body("weather?", stream=False, max_tokens=100,
                                                             tools=[WEATHER])).json()
    cid, (call,) = first["conversation_id"], first["choices"][0]["message"]["tool_calls"]

    def result(call_id: str) -> httpx.Response:
        return http.post("/v1/chat/completions", json={
            "model": MODEL, "conversation_id": cid, "tools": [WEATHER], "max_tokens": 100, "stream": False,
            "messages": [{"role": "tool", "tool_call_id": call_id, "content": "rain"}]})

    for call_id in ("call_nope", call["id"], "call_nope"):
        response = result(call_id)
        if call_id == call["id"]:  # the one waiting result: answered
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == \
                "The result is rain."
            response = result(call_id)  # the same result again: its call has one already
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "messages[0].tool_call_id", "invalid_value", "invalid_request_error"), error
        assert "must be a response to a preceding message with 'tool_calls'" in error["message"]
    stored = http.get(f"/v1/conversations/{cid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]  # nothing refused was kept
    # The whole history, with a result that no assistant message before it asked for: the SDK's 400.
    for history in ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "Sunny"}],
                    [{"role": "user", "content": "weather?"}, first["choices"][0]["message"],
                     {"role": "tool", "tool_call_id": call["id"], "content": "rain"},
                     {"role": "tool", "tool_call_id": call["id"], "content": "rain"}]):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=10)
        assert refused.value.body["param"] == f"messages[{len(history) - 1}].tool_call_id"


UNANSWERED = ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
              "'tool_call_id'. The following tool_call_ids did not have response messages: ")


def _calls(*ids: str) -> dict:
    """An assistant message that calls get_weather once per id."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        for i in ids]}


def _result(call_id: str, content: str = "sunny") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value"), error
    return error


@pytest.mark.parametrize(("messages", "param", "missing"), [
    ([_calls("call_x"), {"role": "user", "content": "and tomorrow?"}], "messages[2].role", "call_x"),
    ([_calls("call_x", "call_y"), _result("call_x"), {"role": "user", "content": "and?"}], "messages[3].role",
     "call_y"),
    ([_calls("call_x"), {"role": "assistant", "content": "no idea"}, {"role": "user", "content": "ok"}],
     "messages[2].role", "call_x"),
    ([_calls("call_x", "call_y"), _result("call_y")], "messages[1].tool_calls", "call_x"),
    ([_calls("call_x", "call_y")], "messages[1].tool_calls", "call_x, call_y"),  # OpenAI's 400 too, not "last message"
])
def test_every_call_has_its_result_before_the_conversation_moves_on(http, messages, param, missing):
    """OpenAI's other rule: an assistant message's calls are all answered before the next user or
    assistant message, and before the messages end. Such a request was served, its prompt holding
    a call the model never heard back from."""
    body = {"model": MODEL, "tools": [WEATHER], "max_tokens": 10, "stream": False,
            "messages": [{"role": "user", "content": "weather?"}, *messages]}
    error = _refusal(http.post("/v1/chat/completions", json=body))
    assert (error["param"], error["message"]) == (param, UNANSWERED + missing), error


def test_sdk_unanswered_calls_are_a_400_and_answered_ones_are_served(sdk, scripted):
    question = {"role": "user", "content": "The weather in two cities, Paris and Rome?"}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=10, stream=stream, messages=[
                question, _calls("call_p", "call_r"), _result("call_p"), {"role": "user", "content": "well?"}])
        error = refused.value.body
        assert (error["message"], error["param"], error["type"]) == (
            UNANSWERED + "call_r", "messages[3].role", "invalid_request_error"), error
    answered = sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=100, messages=[
        question, _calls("call_p", "call_r"), _result("call_p", "sunny"), _result("call_r", "rain")])
    assert answered.choices[0].message.content == "The result is rain."  # (the scripted model reads the last)
    prompt = scripted.engine.tokenizer.decode(scripted.engine.prompts[-1][1])
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    moved_on = sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=10, messages=[
        question, _calls("call_p"), _result("call_p"), {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks!"}])
    assert moved_on.choices[0].message.content == "Hello there."


def test_a_stored_replys_calls_are_answered_before_the_next_message(http, sdk):
    """Continuing a stored conversation whose last reply ended with tool_calls: a new user message
    without their results is refused as OpenAI's Responses API refuses new input while a call of
    the previous response has no output. It was served, the model seeing its call unanswered."""
    first = http.post("/v1/chat/completions", json=chat_body("weather?", stream=False, max_tokens=100,
                                                             tools=[WEATHER])).json()
    cid, (call,) = first["conversation_id"], first["choices"][0]["message"]["tool_calls"]

    def send(*messages: dict) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"model": MODEL, "conversation_id": cid, "tools": [WEATHER],
                                                       "max_tokens": 100, "stream": False, "messages": list(messages)})

    error = _refusal(send({"role": "user", "content": "And in Rome?"}))
    assert error["param"] == "messages[0].role" and error["message"].startswith(UNANSWERED + call["id"]), error
    assert "the conversation's last reply" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=10, extra_body={"conversation_id": cid},
                                    messages=[{"role": "user", "content": "And in Rome?"}])
    assert refused.value.body["message"].startswith(UNANSWERED + call["id"])
    stored = http.get(f"/v1/conversations/{cid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]  # nothing refused was kept
    answered = send(_result(call["id"], "rain"), {"role": "user", "content": "Thanks!"})
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"] == "Hello there."


def test_the_chat_route_documents_the_tool_message_400s(http):
    operation = http.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    described = operation["responses"]["400"]["description"]
    assert "did not have response messages" in described and "messages[i].tool_call_id" in described


@pytest.mark.parametrize(("change", "param", "code"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice",
     "invalid_tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
     "tools[0].function.parameters", "invalid_tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": "zero"}}}}}]}, "tools[0].function.parameters", "invalid_tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_tools"),
    ({"tools": "get_weather"}, "tools", "invalid_value"),  # (the request model's own check)
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "invalid_tools"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{not json"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_tool_arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c2", "content": "x"}]}, "messages[2].tool_call_id",
     "invalid_value"),
])
def test_bad_tool_input_is_a_400(http, change, param, code):
    response = http.post("/v1/chat/completions", json={**chat_body("hi", stream=False), **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert error["message"]


@pytest.mark.parametrize(("sandbox", "why"), [("off", "this replica has no sandbox"),
                                              ("local", "bwrap is not installed (apt-get install bubblewrap)")],
                         ids=["turned-off", "no-bubblewrap"])
def test_without_a_sandbox_the_code_tool_is_off(tmp_path, monkeypatch, sandbox, why):
    from fairway.assembly import ServerOptions, load_tokenizer

    tokenizer = load_tokenizer(None)
    if sandbox == "local":  # a machine without bubblewrap: nothing on PATH (what the runner looks for)
        monkeypatch.setenv("PATH", str(tmp_path))
    options = ServerOptions(database=f"sqlite:///{tmp_path / 'off.db'}", api_keys=list(TEST_KEYS), memory=False,
                            sandbox=sandbox)
    with embedded_server(options, ScriptedEngine(tokenizer, script)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", headers=headers(), timeout=30,
                              json=chat_body("compute", stream=False, tools=[CODE]))
        plain = httpx.post(f"{server.url}/v1/chat/completions", headers=headers(), timeout=30,
                           json=chat_body("weather?", stream=False, max_tokens=100, tools=[WEATHER]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "tool_unavailable" and error["param"] == "tools"
    assert error["message"].startswith("Code execution is off on this server:") and why in error["message"]
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "tool_calls"  # the rest works


# A template with tool support of its own (the shape of Qwen's and Hermes'): tools and tool turns
# are the template's to render, and no system block is added.
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_tool_support_renders_them_itself():
    from fairway.assembly import load_tokenizer
    from fairway.conversation.service import ConversationService
    from fairway.models.tokenizer import Tokenizer
    from fairway.tools.prompt import continuation

    base = load_tokenizer(None)
    native = Tokenizer(base._backend, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                       chat_template=NATIVE_TEMPLATE)
    assert native.supports_tools and not base.supports_tools
    service = ConversationService(None, None, None, {"m": native, "plain": base})  # only its context building
    tools = parse_tools([WEATHER, CODE], "auto")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = native.decode(service._build("m", 4096, [], messages, 64, None, tools).prompt_token_ids)
    assert text == ("<|im_start|>system\nTools: get_weather execute_code<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                    "<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    plain = base.decode(service._build("plain", 4096, [], messages, 64, None, tools).prompt_token_ids)
    assert "# Tools" in plain and "<tool_response>\nsunny\n</tool_response>" in plain
    assert continuation(native.apply_chat_template, "42", [t.to_openai() for t in tools.offered]) == \
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_the_loop_at_scale_redis_postgresql_and_the_sandbox_service(tmp_path):
    """The same loop on the at-scale backends: the token log and the job on Redis, the store on
    PostgreSQL, the code run by a `fairway sandbox` process over gRPC."""
    import os
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    import redis

    from fairway.assembly import ServerOptions, load_tokenizer
    from fairway.sandbox import LocalSandbox
    from tests.pg_admin import temporary_database

    if (reason := LocalSandbox().static_check()) is not None:
        missing("bubblewrap", reason)
    redis_url = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    try:
        redis.Redis.from_url(redis_url).ping()
    except redis.RedisError as exc:
        missing("Redis", str(exc))
    root = Path(__file__).resolve().parent.parent
    service = subprocess.Popen([sys.executable, "-m", "fairway.cli", "sandbox", "--listen", "127.0.0.1:0"], cwd=root,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    namespace = f"test:{uuid.uuid4().hex[:12]}:"
    try:
        sandbox_url = "grpc://" + service.stdout.readline().split()[3]
        with temporary_database() as database:
            if database is None:
                missing("PostgreSQL", "nothing answers for the test database")
            options = ServerOptions(database=database, redis=redis_url, namespace=namespace,
                                    api_keys=list(TEST_KEYS), memory=False, sandbox=sandbox_url)
            engine = ScriptedEngine(load_tokenizer(None), script)
            with embedded_server(options, engine) as server, \
                    httpx.Client(base_url=server.url, headers=headers(), timeout=60) as http:
                events = _stream(http, chat_body("compute, please", max_tokens=200, tools=[CODE]))
                asked = http.post("/v1/chat/completions", json=chat_body(
                    "weather?", stream=False, max_tokens=100, tools=[WEATHER])).json()
                stored = http.get(f"/v1/conversations/{events[0].data['conversation_id']}").json()["messages"]
    finally:
        service.terminate()
        service.wait(10)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{namespace}*"))
        if keys:
            client.delete(*keys)
    ids = [e.id for e in events if e.id is not None]
    assert ids == list(range(1, len(ids) + 1))
    assert [x["status"] for x in _executions(events)] == ["running", "completed"]
    assert "".join(e.content for e in events) == BEFORE_CALL + "The result is 42."
    assert stored[-1]["tool_executions"][0]["output"] == "42"
    assert asked["choices"][0]["finish_reason"] == "tool_calls"
    assert asked["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_old_turns_with_tool_rounds_are_dropped_whole():
    """A tool result is no user turn: when the window is short, a turn leaves with its calls and results."""
    from fairway.assembly import load_tokenizer
    from fairway.conversation.service import ConversationService

    service = ConversationService(None, None, None, {"m": load_tokenizer(None)})
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    old = [{"role": "user", "content": "weather in Paris? " * 20},
           {"role": "assistant", "content": "", "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny " * 20},
           {"role": "assistant", "content": "It is sunny. " * 10}]
    new = [{"role": "user", "content": "thanks"}]
    full = service._build("m", 4096, [], old + new, 64, None, parse_tools([WEATHER], "auto"))
    tight = service._build("m", full.num_tokens + 64 - 20, [], old + new, 64, None, parse_tools([WEATHER], "auto"))
    assert (full.dropped_turns, tight.dropped_turns, tight.dropped_messages) == (0, 1, 4)


async def test_a_replica_finds_a_sandbox_service_that_comes_up_late():
    """Off (and saying why) while the service is unreachable; on once it answers, without a restart."""
    import asyncio
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fairway.assembly import load_tokenizer
    from fairway.engine import AsyncEngine
    from fairway.replica.registry import InProcessRegistry
    from fairway.replica.worker import ReplicaSettings, ReplicaWorker
    from fairway.sandbox import LocalSandbox
    from fairway.sandbox.service import GrpcSandbox
    from tests.serving import free_port

    if (reason := LocalSandbox().static_check()) is not None:
        missing("bubblewrap", reason)
    port = free_port()
    sandbox = GrpcSandbox(f"grpc://127.0.0.1:{port}", timeout_s=0.5)
    registry = InProcessRegistry()
    worker = ReplicaWorker(AsyncEngine(ScriptedEngine(load_tokenizer(None), script)), make_relay(None), registry,
                           ReplicaSettings(model=MODEL, heartbeat_s=0.02), sandbox=sandbox)
    await worker.start()
    root = Path(__file__).resolve().parent.parent
    service = None
    try:
        (info,) = await registry.live()
        assert "unreachable" in info.sandbox_off
        service = subprocess.Popen([sys.executable, "-m", "fairway.cli", "sandbox", "--listen", f"127.0.0.1:{port}"],
                                   cwd=root, stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(root)})
        service.stdout.readline()
        for _ in range(200):
            (info,) = await registry.live()
            if info.sandbox_off == "":
                break
            await asyncio.sleep(0.05)
        assert info.sandbox_off == ""
    finally:
        await worker.stop()
        worker.engine.shutdown()
        await sandbox.close()
        if service is not None:
            service.terminate()
            service.wait(10)
