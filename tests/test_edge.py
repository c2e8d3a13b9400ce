"""The edge on the embedded server (in-process limits, SQLite): keys, token quotas, request rates,
idempotency, the thundering herd, usage and metrics, bad input. The same rules across two
gateways sharing Redis are in test_resume.py."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import logging
import math
import subprocess
import sys
import uuid

import httpx
import pytest
from backends import missing
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    API_KEY,
    HERD_MAX_TOKENS,
    MODEL,
    OTHER_KEY,
    RATE_LIMIT_HEADERS,
    TEST_KEYS,
    ThreadServer,
    chat_body,
    herd_limit,
    herd_prompt,
    sse_events,
    wait_for,
    wait_ready,
)

HERD_KEY = "sk-test-herd-user"  # free tier, with a TPM that fits 5 herd requests
RPM_KEY = "sk-test-rpm-user"  # background tier, 3 requests a minute
RPM = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fairway.assembly import ServerOptions, embedded_app
    from fairway.limits import LimitsConfig, TierLimits
    from fairway.limits.config import default_tiers

    db = tmp_path_factory.mktemp("edge") / "fairway.db"
    tiers = {**default_tiers(), "free": TierLimits(herd_limit(), 1000), "background": TierLimits(100_000, RPM)}
    options = ServerOptions(database=f"sqlite:///{db}", max_model_len=1024, limits=LimitsConfig(tiers=tiers),
                           api_keys=[*TEST_KEYS, (HERD_KEY, "herd-user", "free"), (RPM_KEY, "rpm-user", "background")],
                           auth_cache_s=0.2)
    app = embedded_app(options)
    server = ThreadServer(app).start()
    server.gateway = app.state.gateway
    server.database = f"sqlite:///{db}"
    wait_ready(server.url)
    yield server
    server.stop()


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=auth(), timeout=120) as c:
        yield c


def post_all(server, requests: list[tuple[dict, dict]]) -> list[httpx.Response]:
    """Send every (body, headers) at once; each response read whole."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b, headers=h)
                                          for b, h in requests))

    return asyncio.run(run())


def stream_all(server, requests: list[tuple[dict, dict]]) -> list[tuple[httpx.Headers, list[str]]]:
    """Stream every (body, headers) at once: the response headers and the raw SSE lines of each."""

    async def one(client: httpx.AsyncClient, body: dict, headers: dict) -> tuple[httpx.Headers, list[str]]:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            return r.headers, [line async for line in r.aiter_lines() if line.startswith(("id:", "data:"))]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, b, h) for b, h in requests))

    return asyncio.run(run())


def fairway_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "fairway.cli", *args], check=True, capture_output=True, text=True,
                         timeout=60)
    return out.stdout


# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Basic dXNlcjpwdw==", "Bearer not-a-key",
                                           "Bearer sk-short", "Bearer sk-" + "x" * 300, "Bearer sk-unknown-key-123"])
def test_missing_or_bad_keys_are_401(server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/conversations"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/usage"), ("GET", "/v1/replies/rep_x")):
        r = httpx.request(method, server.url + path, headers=headers, json=chat_body("hi"), timeout=30)
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_the_page_health_and_metrics_need_no_key(server):
    for path in ("/", "/web/app.js", "/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path, timeout=30).status_code == 200, path


def test_keys_cli_create_list_revoke(server):
    out = fairway_cli("keys", "create", "--user", "cli-user", "--tier", "business", "--database", server.database)
    key = out.strip().splitlines()[-1]
    assert key.startswith("sk-fw-") and len(key) > 40
    assert httpx.get(f"{server.url}/v1/models", headers=auth(key), timeout=30).status_code == 200
    listed = fairway_cli("keys", "list", "--user", "cli-user", "--database", server.database)
    assert "cli-user" in listed and "business" in listed and key not in listed  # never the key itself
    revoked = fairway_cli("keys", "revoke", key, "--database", server.database)
    assert "Revoked key_" in revoked
    wait_for(lambda: httpx.get(f"{server.url}/v1/models", headers=auth(key), timeout=30).status_code == 401,
             timeout=10)


def test_rate_limit_headers_on_every_response(http):
    for response in (http.get("/v1/models"), http.get("/v1/conversations"), http.get("/v1/usage"),
                     http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=1, stream=False)),
                     http.post("/v1/chat/completions", json={"model": MODEL}),  # a 400
                     http.get("/v1/replies/rep_missing")):
        assert RATE_LIMIT_HEADERS <= set(response.headers), (response.request.url, response.headers)
    assert int(response.headers["x-ratelimit-limit-requests"]) == 600  # paid tier


# -- token quotas and request rates ------------------------------------------------------------


def test_concurrent_requests_never_overshoot_the_token_quota(server, http):
    """20 concurrent requests against a TPM that fits 5: exactly 5 run, the rest get 429."""
    limit = herd_limit()
    bodies = [chat_body(herd_prompt(i), max_tokens=HERD_MAX_TOKENS, stream=False, ignore_eos=True) for i in range(20)]
    responses = post_all(server, [(b, auth(HERD_KEY)) for b in bodies])
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(refused) == 20, [r.text for r in responses]
    assert sum(int(r.headers["x-context-tokens"]) + HERD_MAX_TOKENS for r in admitted) <= limit
    assert len(admitted) == 5
    for r in refused:
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("tokens", "rate_limit_exceeded", None)
        assert f"Limit {limit}, Used " in error["message"] and "Requested " in error["message"]
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-tokens"]
    # Each reply ends with its reservation settled (to the same count: ignore_eos) and one usage record.
    for r in admitted:
        reply = r.json()["id"]
        usage = wait_for(lambda reply=reply: httpx.get(f"{server.url}/v1/replies/{reply}", headers=auth(HERD_KEY),
                                                       timeout=10).json()["usage"])
        assert (usage["tier"], usage["completion_tokens"], usage["finish_reason"]) == ("free", HERD_MAX_TOKENS, "length")
        assert usage["ttft_s"] > 0 and usage["duration_s"] >= usage["ttft_s"] and usage["cost"] > 0
    state = server.call(server.gateway.limits.tokens.state("herd-user", MODEL, "free"))
    assert state.used == sum(int(r.headers["x-context-tokens"]) + HERD_MAX_TOKENS for r in admitted) <= limit


def test_request_rate_per_user(server):
    responses = [httpx.post(f"{server.url}/v1/chat/completions", headers=auth(RPM_KEY), timeout=60,
                            json=chat_body(f"Say {i}.", max_tokens=1, stream=False)) for i in range(RPM + 1)]
    assert [r.status_code for r in responses] == [200] * RPM + [429]
    error = responses[-1].json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert f"Limit {RPM}, Used {RPM}, Requested 1" in error["message"]
    assert responses[-1].headers["x-ratelimit-remaining-requests"] == "0"
    assert int(responses[-1].headers["retry-after"]) >= 1


def test_request_rate_per_client_ip(server):
    config = server.gateway.limits.config
    saved = config.ip_requests_per_minute
    config.ip_requests_per_minute = 1  # all test clients are 127.0.0.1: the second request is over
    try:
        for _ in range(2):
            response = httpx.post(f"{server.url}/v1/chat/completions", headers=auth(OTHER_KEY), timeout=30,
                                  json=chat_body("Hi", max_tokens=1, stream=False))
    finally:
        config.ip_requests_per_minute = saved
    assert response.status_code == 429
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "127.0.0.1" in error["message"]
    # The headers describe the IP's window that refused (limit 1), none of the user's limits.
    ip_headers = {h for h in RATE_LIMIT_HEADERS if h.endswith("-requests")}
    assert {h for h in RATE_LIMIT_HEADERS if h in response.headers} == ip_headers
    assert (response.headers["x-ratelimit-limit-requests"], response.headers["x-ratelimit-remaining-requests"]) == \
        ("1", "0")
    # Retry-After is when the IP's window has room: within its reset, never after it.
    reset_s = _seconds(response.headers["x-ratelimit-reset-requests"])
    assert 1 <= int(response.headers["retry-after"]) <= max(1, math.ceil(reset_s))


def _seconds(duration: str) -> float:
    """A reset header under an hour (format_reset's "17ms", "7.66s", "1m0s") in seconds."""
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    minutes, _, seconds = duration.rpartition("m")
    return float(minutes or 0) * 60 + float(seconds.removesuffix("s"))


# -- idempotency -----------------------------------------------------------------------------------


def test_ten_concurrent_duplicates_make_one_generation(server, http):
    key = f"idem-{uuid.uuid4().hex}"
    body = chat_body("Name three colours.", max_tokens=8)
    headers = {**auth(), "X-Idempotency-Key": key}
    results = stream_all(server, [(body, headers)] * 10)
    reply_ids = {h["x-reply-id"] for h, _ in results}
    assert len(reply_ids) == 1
    for _, lines in results:
        assert lines == results[0][1]  # ten identical streams, [DONE] included
    assert results[0][1][-1] == "data: [DONE]"
    assert sum(h.get("x-idempotent-replayed") == "true" for h, _ in results) == 9
    conversation = http.get(f"/v1/conversations/{results[0][0]['x-conversation-id']}").json()
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]  # one generation
    reply_id = reply_ids.pop()
    # After it finished: the finished reply, without generating again, from where the client got to.
    with http.stream("POST", "/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": "2"}) as r:
        assert r.headers["x-reply-id"] == reply_id and r.headers["x-idempotent-replayed"] == "true"
        rest = list(sse_events(r))
    assert rest[0].id == 3
    assert len(http.get(f"/v1/conversations/{results[0][0]['x-conversation-id']}").json()["messages"]) == 2
    # The same key with a different body: 409.
    conflict = http.post("/v1/chat/completions", json={**body, "max_tokens": 9}, headers=headers)
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_key_reused"
    assert conflict.headers["x-should-retry"] == "false"  # the SDKs retry a 409 otherwise: the same answer
    # Another user's same key is theirs alone.
    other = http.post("/v1/chat/completions", json={**body, "stream": False},
                      headers={**auth(OTHER_KEY), "X-Idempotency-Key": key})
    assert other.status_code == 200 and other.json()["id"] != reply_id


def test_a_reply_started_is_served_when_its_idempotency_key_cannot_be_recorded(server, http, monkeypatch):
    """The store failing between the claim and the attach: the reply was already started (and
    charged), yet the client got a 503 and would send it again, a second generation."""
    from fairway.limits import LimitsUnavailable

    async def unreachable(*_args, **_kwargs):
        raise LimitsUnavailable("Redis unreachable: test")

    monkeypatch.setattr(server.gateway.limits.idempotency, "attach", unreachable)
    response = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2, stream=False),
                         headers={"X-Idempotency-Key": f"idem-{uuid.uuid4().hex}"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- thundering herd ---------------------------------------------------------------------------


def test_identical_cacheable_requests_share_one_generation(server):
    body = chat_body(f"Spell the word {uuid.uuid4().hex[:6]}.", max_tokens=6)
    results = stream_all(server, [(body, auth())] * 5)
    assert len({h["x-reply-id"] for h, _ in results}) == 1
    assert sum(h.get("x-shared-generation") == "true" for h, _ in results) == 4
    for _, lines in results:
        assert lines == results[0][1]
    # Sampled (temperature > 0) requests are never shared.
    sampled = post_all(server, [({**body, "temperature": 0.7, "stream": False}, auth())] * 2)
    assert sampled[0].json()["id"] != sampled[1].json()["id"]


def test_each_request_sharing_a_generation_is_billed_as_a_request(server):
    """Single flight saves the generation, not the bill: two identical requests are two requests in
    GET /v1/usage, each with the tokens its response's usage reports, as OpenAI bills them; the
    token metrics count the one generation, fairway:chat_requests both requests."""
    def totals() -> dict:
        return httpx.get(f"{server.url}/v1/usage", headers=auth(OTHER_KEY), timeout=30).json()["totals"]

    def prompt_tokens() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "fairway:prompt_tokens")
        return sum(s.value for s in family.samples if s.name.endswith("_total"))

    before, tokens_before, requests_before = totals(), prompt_tokens(), chat_requests(server)
    body = chat_body(f"Spell the word {uuid.uuid4().hex[:6]}.", max_tokens=12, stream=False, ignore_eos=True)
    responses = post_all(server, [(body, auth(OTHER_KEY))] * 2)
    assert [r.headers.get("x-shared-generation") for r in responses].count("true") == 1
    usage = responses[0].json()["usage"]
    assert responses[1].json()["usage"] == usage
    after = wait_for(lambda: (t := totals())["requests"] == before["requests"] + 2 and t)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert after[key] - before[key] == 2 * usage[key], key
    assert after["cost"] > before["cost"]
    assert prompt_tokens() - tokens_before == usage["prompt_tokens"]  # generated once
    moved = {k: v - requests_before.get(k, 0) for k, v in chat_requests(server).items()}
    assert moved[("200", "generated")] == 1 and moved[("200", "shared")] == 1


def test_admission_queue_waits_then_refuses_with_retry_after(server, http):
    from fairway.limits import Admission

    limits = server.gateway.limits
    saved = limits.admission
    limits.admission = Admission(max_in_flight=1, max_waiting=1, timeout_s=0.3)
    try:
        long = chat_body("Count to five hundred.", max_tokens=300, ignore_eos=True)
        with http.stream("POST", "/v1/chat/completions", json=long) as r:
            assert r.status_code == 200
            events = sse_events(r)  # (dropping the iterator would close the connection)
            next(events)  # the one slot is taken while this stream is open
            refused = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=1, stream=False))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
            assert int(refused.headers["retry-after"]) >= 1 and RATE_LIMIT_HEADERS <= set(refused.headers)
            http.post(f"/v1/replies/{r.headers['x-reply-id']}/stop")
        # The slot comes back when the stream is over (here: the client left).
        wait_for(lambda: limits.admission.in_flight == 0, timeout=30)
        ok = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=1, stream=False))
        assert ok.status_code == 200
    finally:
        limits.admission = saved


# -- usage and metrics ----------------------------------------------------------------------------


def test_a_query_parameter_given_twice_is_a_400_naming_it(server, http):
    """Each query parameter takes one value: a second one is refused, not the last taken in silence."""
    for path, name in (("/v1/usage?from=2026-01-01&from=2026-02-01", "from"),
                       ("/v1/conversations?limit=1&limit=2", "limit"),
                       ("/v1/files?order=asc&after=x&order=desc", "order")):
        response = http.get(path)
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error" and "more than once" in error["message"]
    assert http.get("/v1/usage?from=2026-01-01&to=2026-01-02").status_code == 200


def test_usage_per_model_per_day(server, http):
    completion = http.post("/v1/chat/completions", json=chat_body("Say ok.", max_tokens=3, stream=False)).json()
    wait_for(lambda: http.get(f"/v1/replies/{completion['id']}").json()["usage"])
    today = dt.datetime.now(dt.UTC).date().isoformat()
    usage = http.get("/v1/usage", params={"from": today, "to": today}).json()
    row = next(d for d in usage["data"] if d["model"] == MODEL and d["date"] == today)
    assert row["requests"] >= 1 and row["completion_tokens"] >= 1 and row["prompt_tokens"] > 0
    assert row["total_tokens"] == row["prompt_tokens"] + row["completion_tokens"] and row["cost"] > 0
    assert usage["totals"]["requests"] == sum(d["requests"] for d in usage["data"])
    # Unix seconds work too; an empty range is empty.
    assert http.get("/v1/usage", params={"from": "0", "to": "86399"}).json()["data"] == []
    # Another user's usage does not exist for us; theirs holds none of ours.
    assert http.get("/v1/usage", params={"user": "test-user-2"}).status_code == 404
    theirs = http.get("/v1/usage", headers=auth(OTHER_KEY)).json()
    assert theirs["user"] == "test-user-2" and usage["user"] == "test-user-1"
    assert http.get(f"/v1/replies/{completion['id']}", headers=auth(OTHER_KEY)).status_code == 404
    assert http.get("/v1/usage", params={"from": "yesterday"}).status_code == 400
    # Days at the calendar's ends are refused, not a 500 from the range's arithmetic.
    for params in ({"to": "9999-12-31"}, {"to": "0001-01-01"}, {"from": "0001-01-01", "to": "0001-01-02"}):
        edge = http.get("/v1/usage", params=params)
        assert edge.status_code == 400 and edge.json()["error"]["param"] in params, (params, edge.text)


def test_a_reply_this_gateway_relayed_is_recorded_without_reading_it_back_or_saving_it_again(
        server, http, monkeypatch):
    """The recorder of the gateway that launched a reply and saved it at its end knows its job and
    that it is saved (conversation/launched.py): the replica's reports cost it no read of the job
    and no second save, and the reply is still stored, accounted and billed once."""
    store = server.gateway.store
    read_back: list[str] = []
    saved_again: list[str] = []
    get_reply_jobs, finish_replies = store.get_reply_jobs, store.finish_replies

    async def counting_get_reply_jobs(ids):
        read_back.extend(ids)
        return await get_reply_jobs(ids)

    async def counting_finish_replies(endings):
        saved_again.extend(e.reply_id for e in endings)
        return await finish_replies(endings)

    monkeypatch.setattr(store, "get_reply_jobs", counting_get_reply_jobs)
    monkeypatch.setattr(store, "finish_replies", counting_finish_replies)
    with http.stream("POST", "/v1/chat/completions", json=chat_body("Say ok.", max_tokens=3)) as r:
        assert r.status_code == 200
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        events = list(sse_events(r))
    text = "".join(e.data["choices"][0]["delta"].get("content") or "" for e in events if e.data != "[DONE]")
    usage = wait_for(lambda: http.get(f"/v1/replies/{reply_id}").json()["usage"])
    assert usage["completion_tokens"] >= 1 and usage["cost"] > 0 and usage["tier"] == "paid"
    reply = http.get(f"/v1/replies/{reply_id}").json()
    assert reply["state"] == "FINISHED"
    # The recorder's reads and saves, before the conversation's GET reads the jobs for itself.
    assert reply_id not in read_back and reply_id not in saved_again
    stored = [m for m in http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
              if m.get("reply_id") == reply_id]
    assert [m["content"] for m in stored] == [text]
    wait_for(lambda: reply_id not in server.gateway.service.launched)  # forgotten once recorded


def test_metrics_in_prometheus_text(server, http):
    http.post("/v1/chat/completions", json=chat_body("Say yes.", max_tokens=3, stream=False))
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for name in ("fairway:time_to_first_token_seconds_bucket", "fairway:inter_token_latency_seconds_bucket",
                 "fairway:e2e_request_latency_seconds_count", "fairway:prompt_tokens_total",
                 "fairway:generation_tokens_total", "fairway:kv_cache_usage_perc",
                 "fairway:prefix_cache_queries_total", "fairway:prefix_cache_hits_total",
                 "fairway:num_preemptions_total", "fairway:num_requests_running", "fairway:num_requests_waiting",
                 "fairway:spec_decode_num_drafts_total", "fairway:spec_decode_num_draft_tokens_total",
                 "fairway:spec_decode_num_accepted_tokens_total", "fairway:spec_decode_draft_acceptance_rate",
                 "fairway:active_streams", "fairway:rate_limited_total", "fairway:gc_pause_seconds_bucket"):
        assert name in text, name
    assert f'fairway:prompt_tokens_total{{model="{MODEL}",tier="paid"}}' in text
    assert 'fairway:rate_limited_total{type="tokens"}' in text  # from the quota test (same process)


def chat_requests(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    family = next((f for f in text_string_to_metric_families(text) if f.name == "fairway:chat_requests"), None)
    return {(s.labels["status"], s.labels["outcome"]): s.value
            for s in (family.samples if family else []) if s.name.endswith("_total")}


def test_metrics_count_each_chat_request_by_what_it_got(server, http):
    """An operator reads from fairway:chat_requests what the edge answered: a reply generated, a bad
    request, a message the input check refused (none of which moved a token counter)."""
    before = chat_requests(server)
    assert http.post("/v1/chat/completions", json=chat_body("Say one.", max_tokens=2, stream=False)).status_code == 200
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    flagged = http.post("/v1/chat/completions", json=chat_body("I will kill you.", stream=False))
    assert flagged.json()["error"]["code"] == "content_policy_violation"
    after = chat_requests(server)
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert moved == {("200", "generated"): 1, ("400", "empty_array"): 1, ("400", "content_policy_violation"): 1}


def test_metrics_time_each_garbage_collection(server):
    def collections(generation: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        pauses = next(f for f in text_string_to_metric_families(text) if f.name == "fairway:gc_pause_seconds")
        return next(s.value for s in pauses.samples
                    if s.name.endswith("_count") and s.labels["generation"] == generation)

    before = collections("1")
    gc.collect(1)  # this process is the server's (ThreadServer)
    assert collections("1") >= before + 1


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "headers", "status", "code", "param"),
    [
        ({"max_tokens": -5}, {}, 400, "invalid_value", "max_tokens"),
        ({"max_tokens": 10**12}, {}, 400, "max_tokens_exceeds_quota", "max_tokens"),
        ({}, {"X-Idempotency-Key": "k" * 256}, 400, "invalid_idempotency_key", "X-Idempotency-Key"),
        ({"message_id": "k" * 256}, {}, 400, "invalid_value", "message_id"),
        ({}, {"X-Big": "x" * 20_000}, 431, "request_header_too_large", None),
        ({}, {f"X-Many-{i}": "y" * 1000 for i in range(20)}, 431, "request_header_too_large", None),
    ],
)
def test_bad_edge_input_is_a_clear_4xx(http, extra, headers, status, code, param):
    response = http.post("/v1/chat/completions", json={**chat_body("hi", stream=False), **extra}, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param) and error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_request_larger_than_the_quota_is_400_not_429(server):
    """Within the quota alone, max_tokens may still not fit with the prompt: waiting never helps."""
    body = chat_body(herd_prompt(0), max_tokens=herd_limit() - 5, stream=False)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth(HERD_KEY), timeout=30)
    assert response.status_code == 400 and "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "Request too large" in error["message"]


@pytest.mark.parametrize("field", ["header", "message_id"])
def test_idempotency_key_at_the_limit_is_fine(http, field):
    """The header and the body's message_id carry the same key, under the same limit; a resend
    under a key that long attaches to the first reply."""
    key = f"{field}-{uuid.uuid4().hex}".ljust(255, "k")
    body = chat_body("Hi", max_tokens=1, stream=False)
    if field == "message_id":
        body, headers = {**body, "message_id": key}, {}
    else:
        headers = {"X-Idempotency-Key": key}
    first = http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == 200, first.text
    again = http.post("/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 200 and again.headers["x-idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]


# -- NUL characters: the same 400 on both stores ------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    """One engine for both stores' servers (each runs it in its own AsyncEngine thread, one at a time)."""
    from fairway.assembly import ServerOptions, build_engine

    return build_engine(ServerOptions(max_model_len=512))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def on_each_store(request, engine, tmp_path_factory):
    """The embedded server on SQLite, then on PostgreSQL (which refuses a NUL in any text, where
    SQLite stores it: the API must not answer differently)."""
    from pg_admin import PG_HOST, temporary_database

    from fairway.assembly import ServerOptions, embedded_app

    with temporary_database() if request.param == "postgresql" else contextlib.nullcontext() as pg_url:
        if request.param == "postgresql" and pg_url is None:
            missing("PostgreSQL", f"nothing answers at {PG_HOST}")
        database = pg_url or f"sqlite:///{tmp_path_factory.mktemp('nul') / 'fairway.db'}"
        app = embedded_app(ServerOptions(max_model_len=512, api_keys=list(TEST_KEYS), database=database), engine)
        server = ThreadServer(app).start()
        try:
            wait_ready(server.url)
            server.backend = request.param
            yield server
        finally:
            server.stop()


NUL = "hi\u0000there"
TOOL = {"type": "function", "function": {"name": "f", "description": NUL, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"messages": [{"role": "user", "content": NUL}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": NUL}, {"role": "user", "content": "hi"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": NUL}]}]}, "messages[0].content[0].text"),
    ({"conversation_id": NUL}, "conversation_id"),
    ({"message_id": NUL}, "message_id"),
    ({"stop": ["ok", NUL]}, "stop[1]"),
    ({"tools": [TOOL]}, "tools[0].function.description"),
])
def test_a_nul_in_a_body_field_is_400_invalid_text_on_both_stores(on_each_store, extra, param):
    body = {**chat_body("hi", max_tokens=4, stream=False), **extra}
    response = httpx.post(f"{on_each_store.url}/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert response.status_code == 400, (on_each_store.backend, response.text)  # was a 500 on PostgreSQL
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_text", param, "invalid_request_error")
    assert "NUL" in error["message"]


@pytest.mark.parametrize(("method", "path", "params", "param"), [
    ("GET", "/v1/conversations/%00", {}, None),
    ("DELETE", "/v1/conversations/%00", {}, None),
    ("GET", "/v1/replies/%00", {}, None),
    ("GET", "/v1/replies/%00/stream", {}, None),
    ("POST", "/v1/replies/%00/stop", {}, None),
    ("GET", "/v1/files/%00", {}, None),
    ("GET", "/v1/files", {"after": "\u0000"}, "after"),
    ("GET", "/v1/conversations", {"before": "1\u0000"}, "before"),
])
def test_a_nul_in_the_url_is_400_at_the_edge_on_both_stores(on_each_store, method, path, params, param):
    response = httpx.request(method, on_each_store.url + path, params=params, headers=auth(), timeout=60)
    assert response.status_code == 400, (on_each_store.backend, response.text)  # a 500 on PostgreSQL, 404 on SQLite
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_request", param, "invalid_request_error")
    assert "NUL" in error["message"]


def test_text_the_database_refuses_past_the_checks_is_400_not_500(on_each_store):
    """A body the framework parses (not the chat's checks) takes a NUL to the store: PostgreSQL's
    refusal is the store's InvalidText, a 400 (it was a 500); SQLite finds no such conversation."""
    response = httpx.post(f"{on_each_store.url}/v1/user/memory/extract", headers=auth(), timeout=60,
                          json={"conversation_id": "conv\u0000", "use_model": False})
    if on_each_store.backend == "sqlite":
        assert response.status_code == 404, response.text
        return
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_text"


# -- a 500 ------------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_500_closes_its_connection_and_is_logged_once(server, http, monkeypatch):
    """Starlette answered the 500, then raised the error on to uvicorn, which logged it again and
    reset the connection: a keep-alive client's next request on it failed. The 500 says
    Connection: close, so the client opens a new one."""
    async def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.gateway.store, "list_conversations", broken)
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "fairway.gateway.errors")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        first = http.get("/v1/conversations")
        second = http.get("/v1/models")  # the same client, keep-alive
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert first.status_code == 500 and first.headers["connection"] == "close"
    assert first.json()["error"]["type"] == "server_error"
    assert second.status_code == 200
    assert records.messages == ["unhandled error"]


def test_a_backend_that_refuses_the_connection_is_a_503_to_retry(server, http, monkeypatch):
    """A socket to a backend refused where no store mapped it (memory's or files' engine
    connecting to a PostgreSQL that is down): 503 with Retry-After, as a store unavailable."""
    async def refused(*_args, **_kwargs):
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")

    monkeypatch.setattr(server.gateway.store, "list_conversations", refused)
    answer = http.get("/v1/conversations")
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "backend_unavailable"
