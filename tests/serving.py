"""Helpers for the API tests: a real HTTP server on a free port, and an SSE reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from fairway.gateway.http_protocol import server_config

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-test-user-1"
OTHER_KEY = "sk-test-user-2"
USER, OTHER_USER = "test-user-1", "test-user-2"
# What the embedded test servers store at startup (ServerOptions.api_keys): (key, user, tier).
TEST_KEYS = [(API_KEY, USER, "paid"), (OTHER_KEY, OTHER_USER, "paid")]
# The safety server's policy edit (conftest.safety_api_server): a word added to the violence terms
# that the greedy answer about cats writes in its second sentence, so that reply turns flagged mid-way.
FLAGGED_WORD = "domesticated"
# The chat API's server (conftest's chat_api_server): its window, and when a reply nobody listens to stops.
CHAT_API_WINDOW = 1024
CHAT_API_IDLE_CANCEL_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving an ASGI app on its own thread and event loop, like `fairway serve` does."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(app, "127.0.0.1", self.port, "warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="test-uvicorn", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        state = getattr(getattr(app, "state", None), "gateway", None)
        if state is not None:  # a Fairway app: remember its loop, to reach its backends from tests
            state.on_startup.append(self._capture_loop)

    async def _capture_loop(self) -> None:
        self.loop = asyncio.get_running_loop()

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's event loop (where its backends live) and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, timeout: float = 60.0) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


@contextlib.contextmanager
def embedded_server(options: Any, engine: Any = None, mini_engine: Any = None) -> Iterator[ThreadServer]:
    """`fairway serve`'s app for these ServerOptions (on this engine, else the options' model; its
    mini pool's on mini_engine), served on a free port until the block ends (server.gateway: its
    GatewayContext)."""
    from fairway.assembly import embedded_app

    app = embedded_app(options, engine, mini_engine)
    server = ThreadServer(app).start()
    server.gateway = app.state.gateway
    try:
        wait_ready(server.url)
        yield server
    finally:
        server.stop()


def wait_ready(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{url}/ready", timeout=2.0)
            if last.status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.25)
    raise RuntimeError(f"{url} never became ready: {getattr(last, 'text', last)}")


@dataclass
class Event:
    id: int | None
    data: Any  # parsed JSON, or the string "[DONE]"

    @property
    def content(self) -> str:
        if not isinstance(self.data, dict) or not self.data.get("choices"):
            return ""
        return self.data["choices"][0].get("delta", {}).get("content") or ""

    @property
    def finish_reason(self) -> str | None:
        if not isinstance(self.data, dict) or not self.data.get("choices"):
            return None
        return self.data["choices"][0].get("finish_reason")


def sse_events(response: httpx.Response) -> Iterator[Event]:
    """SSE events as the spec frames them (comments skipped)."""
    event_id: int | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data:
                raw = "\n".join(data)
                yield Event(event_id, raw if raw == "[DONE]" else json.loads(raw))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def chat_body(content: str, max_tokens: int = 8, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def headers(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_for(predicate, timeout: float = 30.0, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)


# -- the token-quota herd: many requests that each reserve exactly the same number of tokens -----

HERD_MAX_TOKENS = 4


def herd_prompt(i: int) -> str:
    return f"Request number {i:02d}: say hi."


def herd_reservation(window: int = 1024) -> int:
    """What each herd request reserves: its prompt (built as the gateway builds it) + max_tokens."""
    from fairway.assembly import load_tokenizer
    from fairway.conversation.context_builder import ContextBuilder

    builder = ContextBuilder(load_tokenizer(None), window)
    sizes = {builder.build([], [], [{"role": "user", "content": herd_prompt(i)}], HERD_MAX_TOKENS).num_tokens
             for i in range(20)}
    assert len(sizes) == 1, sizes  # every herd request costs the same
    return sizes.pop() + HERD_MAX_TOKENS


def herd_limit() -> int:
    """A tokens-per-minute limit that 5 herd requests fit and a 6th does not."""
    return 5 * herd_reservation() + herd_reservation() // 2


RATE_LIMIT_HEADERS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                      "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
