"""Resume, stop and "nobody listening" across processes: two `fairway gateway` processes and one
`fairway replica` on one Redis and one PostgreSQL database, as deployed at scale. A client
starts a reply on one gateway, drops, and carries on through the other. The edge's shared
limits too: token quotas and idempotency keys hold across the two gateways (Redis)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import asyncpg
import httpx
import openai
import pytest
from backends import missing
from pg_admin import PG_HOST, temporary_database, terminate_lock_waiters
from processes import Processes, start_keys
from serving import (
    HERD_MAX_TOKENS,
    MODEL,
    RATE_LIMIT_HEADERS,
    chat_body,
    free_port,
    herd_prompt,
    sse_events,
    wait_for,
    wait_ready,
)
from serving import herd_limit as tight_limit

from fairway.gateway.cursor import RUN_SPAN

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

IDLE_CANCEL_S = 2.0
WINDOW = 4096  # tokens a reply may reach: the idle-cancel test needs one that runs for seconds
KEYS: dict[str, str] = {}  # user -> key, made with `fairway keys create` against the test database


def headers(user: str = "resume-user") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[user]}"}


@pytest.fixture(scope="module", params=["redis", "cluster"])
def redis_url(request):
    """The Redis the processes share: one server, or a local three-master Redis Cluster."""
    return request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else REDIS_URL


@pytest.fixture(scope="module")
def database(redis_url):
    """A database of its own for each Redis the module runs on (its replies' ids are fixed)."""
    with temporary_database() as url:
        if url is None:
            missing("PostgreSQL", f"nothing answers at {PG_HOST}")
        yield url


@pytest.fixture(scope="module")
def namespace():
    import redis

    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def herd_limit() -> int:
    return tight_limit()


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, database, namespace, herd_limit, redis_url):
    """URLs of two gateway processes sharing one replica process (and their users' keys)."""
    procs = Processes(tmp_path_factory.mktemp("procs"))
    shared = ["--redis", redis_url, "--namespace", namespace]
    procs.start("replica", "replica", *shared, "--idle-cancel", str(IDLE_CANCEL_S), "--max-model-len", str(WINDOW),
                "--log-level", "warning")
    keys = start_keys(database, ("resume-user", "paid"), ("herd-user", "free"))
    urls = []
    for name in ("gateway-a", "gateway-b"):
        port = free_port()
        procs.start(name, "gateway", *shared, "--database", database, "--port", str(port), "--log-level", "warning",
                    "--tpm", f"free={herd_limit}")
        urls.append(f"http://127.0.0.1:{port}")
    try:
        KEYS["resume-user"], KEYS["herd-user"] = keys()
        for url in urls:
            wait_ready(url, timeout=120)
    except RuntimeError:
        procs.stop()
        raise RuntimeError(procs.tails()) from None
    yield urls
    procs.stop()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["resume-user"], max_retries=0, timeout=120)


def stored_message(url: str, conversation_id: str, reply_id: str, timeout: float = 30.0) -> dict:
    def find():
        body = httpx.get(f"{url}/v1/conversations/{conversation_id}", headers=headers(), timeout=10).json()
        return next((m for m in body.get("messages", []) if m.get("reply_id") == reply_id), None)

    return wait_for(find, timeout)


def test_a_reply_resumes_through_the_other_gateway(gateways):
    a, b = gateways
    prompt = [{"role": "user", "content": "Count from one to forty in words, separated by commas."}]
    # Gateway A, official SDK: read up to event 4, then the connection drops.
    stream = sdk(a).chat.completions.create(model=MODEL, messages=prompt, max_tokens=40, temperature=0,
                                            stream=True, extra_body={"message_id": "m-resume-1"})
    seen = []
    for chunk in stream:
        seen.append(chunk)
        if chunk.choices[0].model_extra["checkpoint_id"] == "tok_4":
            break
    stream.close()
    reply_id = seen[0].id
    conversation_id = seen[0].model_extra["conversation_id"]
    text = "".join(c.choices[0].delta.content or "" for c in seen)
    # Gateway B, Last-Event-ID 4: events 5.. at once from the log, then live; drop again at 8.
    with httpx.stream("GET", f"{b}/v1/replies/{reply_id}/stream", headers={**headers(), "Last-Event-ID": "4"},
                      timeout=60) as r:
        assert r.status_code == 200
        ids = []
        for event in sse_events(r):
            ids.append(event.id)
            text += event.content
            if event.id == 8:
                break
    assert ids == [5, 6, 7, 8]
    # Gateway B again, the seed's way: the same request with last_received_token_index.
    rest = sdk(b).chat.completions.create(
        model=MODEL, messages=prompt, max_tokens=40, temperature=0, stream=True,
        extra_body={"message_id": "m-resume-1", "last_received_token_index": 8},
    )
    chunks = list(rest)
    assert chunks[0].id == reply_id and chunks[0].choices[0].model_extra["checkpoint_id"] == "tok_9"
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # Nothing lost, nothing repeated: the stored reply (PostgreSQL, read through either gateway).
    for url in (a, b):
        message = stored_message(url, conversation_id, reply_id)
        assert message["status"] == "complete" and message["content"] == text
    # The next turn of that conversation, through the other gateway: its history comes from
    # PostgreSQL, and the conversation lists first, with all four messages in order.
    follow = sdk(b).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And backwards?"}],
                                            max_tokens=4, temperature=0,
                                            extra_body={"conversation_id": conversation_id})
    assert follow.model_extra["conversation_id"] == conversation_id
    assert follow.model_extra["context"]["prompt_tokens"] > len(text.split())  # the first turn is in it
    body = httpx.get(f"{a}/v1/conversations/{conversation_id}", headers=headers(), timeout=10).json()
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]
    assert body["messages"][2]["content"] == "And backwards?"
    listed = httpx.get(f"{a}/v1/conversations", headers=headers(), timeout=10).json()["data"]
    assert listed[0]["id"] == conversation_id


async def test_a_database_connection_lost_mid_request_is_a_503_and_the_request_again_works(gateways, database):
    """PostgreSQL drops the connection a request is using (pg_terminate_backend, a failover): the
    user gets a 503 in OpenAI's shape with Retry-After, at once, and the same request again
    succeeds on a new connection."""
    a, _ = gateways
    async with httpx.AsyncClient(base_url=a, headers=headers(), timeout=30) as client:
        chat = await client.post("/v1/chat/completions", json=chat_body("Say hi.", max_tokens=2, stream=False))
        conversation_id, reply_id = chat.json()["conversation_id"], chat.json()["id"]
        await asyncio.to_thread(stored_message, a, conversation_id, reply_id)  # both saves are done with the row
        admin = await asyncpg.connect(database)
        try:
            async with admin.transaction():  # holds the conversation, so the delete waits midway
                assert await admin.fetchval("SELECT id FROM conversations WHERE id = $1 FOR UPDATE",
                                            conversation_id) == conversation_id
                deleting = asyncio.ensure_future(client.delete(f"/v1/conversations/{conversation_id}"))
                await terminate_lock_waiters(admin, "%FOR UPDATE%")
                refused = await deleting
        finally:
            await admin.close()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "store_unavailable"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        again = await client.delete(f"/v1/conversations/{conversation_id}")
        assert again.status_code == 200 and again.json()["deleted"] is True


def test_stop_through_the_other_gateway(gateways):
    a, b = gateways
    body = chat_body("Write a long story about a lighthouse keeper.", max_tokens=200)
    with httpx.stream("POST", f"{a}/v1/chat/completions", json=body, headers=headers(), timeout=60) as r:
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        events = []
        for event in sse_events(r):
            events.append(event)
            if len(events) == 3:
                stop = httpx.post(f"{b}/v1/replies/{reply_id}/stop", headers=headers(), timeout=10)
                assert stop.json()["stop_requested"] is True
    final = next(e for e in events if e.finish_reason)
    assert final.finish_reason == "stop" and final.data["stopped"] is True
    text = "".join(e.content for e in events)
    message = stored_message(b, conversation_id, reply_id)
    assert message["status"] == "stopped" and message["content"] == text


def test_a_log_redis_lost_mid_stream_runs_again_and_the_client_is_told_to_start_over(gateways, redis_url,
                                                                                    namespace):
    """Redis loses a reply's log mid-stream (here: it is deleted; a Redis restarted without its
    data alike): the replica's next append finds no log and drops its copy, the gateway finds the
    log gone and runs the reply again from its stored context; the client gets an empty snapshot
    (drop the text so far) and the new run whole, and the store keeps the new run's text, not the
    two spliced."""
    import redis
    import redis.cluster

    a, _ = gateways
    body = chat_body("Write a long story about a lighthouse keeper.", max_tokens=48, ignore_eos=True)
    with httpx.stream("POST", f"{a}/v1/chat/completions", json=body, headers=headers(), timeout=120) as r:
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        events, text = [], ""
        for event in sse_events(r):
            events.append(event)
            if len(events) == 4:
                plain = redis.Redis.from_url(redis_url)
                client = (redis.cluster.RedisCluster.from_url(redis_url)
                          if plain.info("cluster").get("cluster_enabled") else plain)
                assert client.delete(f"{namespace}reply:{{{reply_id}}}") == 1
                client.close()
                plain.close()
            if event.data != "[DONE]" and event.data.get("snapshot"):
                text = ""
            text += event.content
    snapshots = [e for e in events if e.data != "[DONE]" and e.data.get("snapshot")]
    assert len(snapshots) == 1 and snapshots[0].content == "" and snapshots[0].id == RUN_SPAN, events
    new_run = events[events.index(snapshots[0]) + 1:-1]
    assert [e.id for e in new_run] == [RUN_SPAN + n for n in range(1, len(new_run) + 1)]
    assert new_run[-1].finish_reason == "length"
    message = stored_message(a, conversation_id, reply_id)
    assert message["status"] == "complete" and message["content"] == text


def test_nobody_listening_cancels_the_reply(gateways):
    a, b = gateways
    # ignore_eos and most of the window: at even 500 tokens/s the reply would run 7 s, well past the
    # idle timeout and the check's period (900 tokens ran out first on a fast CPU).
    max_tokens = WINDOW - 500
    body = chat_body("Write a very long essay about the history of Rome.", max_tokens=max_tokens, ignore_eos=True)
    with httpx.stream("POST", f"{a}/v1/chat/completions", json=body, headers=headers(), timeout=60) as r:
        reply_id, conversation_id = r.headers["x-reply-id"], r.headers["x-conversation-id"]
        next(sse_events(r))
    started = time.monotonic()
    message = stored_message(b, conversation_id, reply_id, timeout=IDLE_CANCEL_S + 30)
    assert message["status"] == "stopped" and message["usage"]["completion_tokens"] < max_tokens
    assert time.monotonic() - started >= IDLE_CANCEL_S - 0.5


# -- the edge across gateways: the limits live in Redis -----------------------------------------


async def _post_all(requests: list[tuple[str, dict, dict]]) -> list[httpx.Response]:
    """Send every (url, body, headers) at once; each response read whole."""
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=body, headers=h)
                                      for url, body, h in requests))


def test_token_quota_never_overshoots_across_two_gateways(gateways, herd_limit):
    """20 concurrent requests, 10 through each gateway, against a TPM that fits 5 of them."""
    a, b = gateways
    bodies = [chat_body(herd_prompt(i), max_tokens=HERD_MAX_TOKENS, stream=False, ignore_eos=True)
              for i in range(20)]
    responses = asyncio.run(_post_all([((a, b)[i % 2], body, headers("herd-user")) for i, body in enumerate(bodies)]))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(refused) == 20, [r.text for r in responses if r.status_code not in (200, 429)]
    reserved = sum(int(r.headers["x-context-tokens"]) + HERD_MAX_TOKENS for r in admitted)
    assert reserved <= herd_limit  # never overshoots...
    assert len(admitted) == 5  # ...and wastes nothing: exactly the 5 that fit
    for r in refused:
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert f"Limit {herd_limit}" in error["message"] and "Requested" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
    for r in responses:
        assert r.headers["x-ratelimit-limit-tokens"] == str(herd_limit)
        assert RATE_LIMIT_HEADERS <= set(r.headers)
    # Each admitted reply is accounted once, whichever gateway recorded it.
    reply = admitted[0].json()["id"]

    def usage_recorded():
        body = httpx.get(f"{b}/v1/replies/{reply}", headers=headers("herd-user"), timeout=10).json()
        return body.get("usage")

    usage = wait_for(usage_recorded)
    assert usage["completion_tokens"] == HERD_MAX_TOKENS and usage["tier"] == "free"


def test_idempotent_duplicates_across_gateways_share_one_reply(gateways):
    a, b = gateways
    key = {**headers(), "X-Idempotency-Key": f"dup-{uuid.uuid4().hex}"}
    body = chat_body("Name three rivers.", max_tokens=8)

    async def stream_all() -> list[tuple[str, list]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(url: str) -> tuple[str, list]:
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=key) as r:
                    assert r.status_code == 200, await r.aread()
                    lines = [line async for line in r.aiter_lines() if line.startswith(("id:", "data:"))]
                return r.headers["x-reply-id"], lines

            return await asyncio.gather(*(one((a, b)[i % 2]) for i in range(6)))

    results = asyncio.run(stream_all())
    assert len({reply for reply, _ in results}) == 1
    for _, lines in results:
        assert lines == results[0][1], (lines, results[0][1])
    # The same key with another body is a conflict.
    other = httpx.post(f"{a}/v1/chat/completions", json={**body, "max_tokens": 9}, headers=key, timeout=30)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
