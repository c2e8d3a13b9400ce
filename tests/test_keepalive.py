"""A reply that pauses mid-stream for longer than the keepalive interval (a stalled replica, a tool
running, a failover) reaches the official OpenAI SDK whole: the gateway's keepalives in the pause
are ignored by it, not taken for an event with empty data (which made the SDK raise
JSONDecodeError and lose the stream).

A real gateway on real Redis; the test itself is the replica: it announces one, claims the
reply's job from the queue and writes its tokens into the token log, with a real pause between
them several keepalive intervals long."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import httpx
import openai
import pytest
from backends import missing
from serving import API_KEY, MODEL, TEST_KEYS, ThreadServer, chat_body, headers, wait_ready

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
KEEPALIVE_S = 0.2
# On Redis an idle stream is woken by the live events' sweep, once a second (make_relay's block_s):
# a keepalive goes out at each sweep after KEEPALIVE_S of quiet, so 2.5 s hold two or three.
PAUSE_S = 2.5
BEFORE, AFTER = ["Hello", ",", " wor"], ["ld", "!"]


@pytest.fixture(scope="module")
def namespace():
    from redis_keys import delete_prefixed

    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    asyncio.run(delete_prefixed(REDIS_URL, prefix))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, namespace):
    from fairway.assembly import ServerOptions, gateway_app

    options = ServerOptions(redis=REDIS_URL, namespace=namespace, keepalive_s=KEEPALIVE_S, api_keys=list(TEST_KEYS),
                           database=f"sqlite:///{tmp_path_factory.mktemp('keepalive') / 'fairway.db'}")
    try:
        app = gateway_app(options)
        server = ThreadServer(app).start()
    except Exception as exc:  # the app pings Redis at startup
        missing("Redis", f"the gateway could not start on {REDIS_URL}: {exc}")
    yield server
    server.stop()


class PausingReplica:
    """Serves one reply of MODEL: BEFORE's tokens, a pause of PAUSE_S, AFTER's, the end."""

    def __init__(self, namespace: str, batched: bool = False) -> None:
        self.namespace = namespace
        self.batched = batched  # BEFORE's tokens in one append round trip, as one engine step can send them
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.paused_between: tuple[int, int] | None = None  # the event ids either side of the pause
        self._thread = threading.Thread(target=self._run, name="pausing-replica", daemon=True)

    def start(self) -> PausingReplica:
        self._thread.start()
        assert self.ready.wait(30) and self.error is None, self.error
        return self

    def join(self) -> None:
        self._thread.join(60)
        if self.error:
            raise self.error

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        from fairway.domain import ReplyState
        from fairway.relay import FinalEvent, TokenEvent, make_relay
        from fairway.replica.job import replica_queue
        from fairway.replica.registry import ReplicaInfo, make_registry

        relay = make_relay(REDIS_URL, prefix=self.namespace)
        registry = make_registry(REDIS_URL, prefix=self.namespace, ttl_s=60)  # it announces only once
        # The same queue for every instance: a gateway's view of the registry may be up to half a
        # second old, and then still name the previous instance (same id) and its queue.
        queue = replica_queue("pausing-replica")
        try:
            await registry.announce(ReplicaInfo("pausing-replica", MODEL, queue, 1024, 1024, capacity=1))
            self.ready.set()
            claimed = await relay.jobs.claim(queue=queue, timeout=30)
            assert claimed is not None, "the gateway queued no job"
            reply_id = claimed.job["reply_id"]
            n = 0
            if self.batched:
                results = await relay.log.append_many([(reply_id, TokenEvent(0, text)) for text in BEFORE])
                n = max(r for r in results if isinstance(r, int))
            for text in [] if self.batched else BEFORE:
                n = await relay.log.append(reply_id, TokenEvent(0, text))
            await asyncio.sleep(PAUSE_S)
            self.paused_between = (n, n + 1)
            for text in AFTER:
                await relay.log.append(reply_id, TokenEvent(0, text))
            await relay.log.finish(reply_id, FinalEvent(0, "stop", ReplyState.FINISHED, 5, 0, len(BEFORE + AFTER)))
        finally:
            await registry.close()
            await relay.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_the_sdk_streams_a_reply_through_a_pause_longer_than_the_keepalive(gateway, namespace, batched):
    """Also when several of a reply's events arrive together (one append round trip)."""
    replica = PausingReplica(namespace, batched).start()
    wait_ready(gateway.url)  # ready once a replica serves the model: this one
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            stream=True)
    chunks = list(stream)  # JSONDecodeError here was the bug
    replica.join()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(BEFORE + AFTER)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].model_extra["checkpoint_id"] for c in chunks] == [f"tok_{n}" for n in range(1, 7)]
    assert replica.paused_between == (3, 4)


def test_the_keepalives_are_comment_lines_inside_the_pause(gateway, namespace):
    """On the wire: `: keepalive` lines, each alone (no blank line after it), between event 3 and 4."""
    replica = PausingReplica(namespace).start()
    wait_ready(gateway.url)
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=chat_body("Say hello.", max_tokens=None),
                      headers=headers(), timeout=60) as r:
        raw = b"".join(r.iter_raw()).decode()
    replica.join()
    before, pause_and_after = raw.split("id: 4\n", 1)[0], raw.split("id: 3\n", 1)[1].split("id: 4\n", 1)[0]
    assert ": keepalive" not in before.split("id: 3\n")[0]  # none while tokens flowed
    assert pause_and_after.count(": keepalive\n") >= 2  # several in the pause
    assert ": keepalive\n\n" not in raw and "\n\n\n" not in raw  # never an empty event
