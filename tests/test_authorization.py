"""Who may see what, route by route, on both backend pairs (in process + SQLite, Redis +
PostgreSQL), over real HTTP: without a key or with a revoked one every API route is a 401; another
user's conversation, reply or usage is a 404 (its existence does not leak), and nothing of it
changes. A resource kind that comes later (memories, files) is one more row of OWNED."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from backends import missing
from pg_admin import PG_HOST, temporary_database
from serving import (
    API_KEY,
    MODEL,
    OTHER_KEY,
    OTHER_USER,
    TEST_KEYS,
    USER,
    ThreadServer,
    chat_body,
    headers,
    wait_for,
    wait_ready,
)

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REVOKED_KEY = "sk-test-revoked-user"
MESSAGE_ID = "authz-message-1"  # the owner's client key for their message


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # {conversation_id}, {reply_id}, {message_id}: the owner's
    json: dict[str, Any] | None = None
    params: dict[str, str] = field(default_factory=dict)
    upload: bool = False  # a multipart body with a small text file

    def send(self, server, key: str | None, ids: dict[str, str]) -> httpx.Response:
        json = None if self.json is None else {k: v.format(**ids) if isinstance(v, str) else v
                                                for k, v in self.json.items()}
        files = {"file": ("note.txt", b"A small note.", "text/plain")} if self.upload else None
        data = {"purpose": "assistants"} if self.upload else None
        return httpx.request(self.method, server.url + self.path.format(**ids), json=json, files=files, data=data,
                             params={k: v.format(**ids) for k, v in self.params.items()},
                             headers=headers(key) if key else {}, timeout=60)


CHAT = chat_body("Say hi.", max_tokens=2, stream=False)
# Routes that name something of the owner's: another user gets 404, as for something that does not exist.
OWNED = [
    Route("GET", "/v1/conversations/{conversation_id}"),
    Route("DELETE", "/v1/conversations/{conversation_id}"),
    Route("GET", "/v1/replies/{reply_id}"),
    Route("GET", "/v1/replies/{reply_id}/stream"),
    Route("POST", "/v1/replies/{reply_id}/stop"),
    Route("GET", "/v1/usage", params={"user": USER}),
    Route("POST", "/v1/chat/completions", json={**CHAT, "conversation_id": "{conversation_id}"}),
    Route("POST", "/v1/chat/completions", json={**CHAT, "message_id": "{message_id}", "last_received_token_index": 1}),
    Route("GET", "/v1/files/{file_id}"),
    Route("GET", "/v1/files/{file_id}/content"),
    Route("DELETE", "/v1/files/{file_id}"),
    Route("POST", "/v1/files/{file_id}/complete"),
    Route("DELETE", "/v1/user/memory/{memory_id}"),
    Route("POST", "/v1/user/memory/extract", json={"conversation_id": "{conversation_id}", "use_model": False}),
]
# Routes that name nothing: another user gets their own (checked below to hold none of the owner's).
UNOWNED = [
    Route("GET", "/v1/models"),
    Route("GET", "/v1/conversations"),
    Route("GET", "/v1/usage"),
    Route("POST", "/v1/chat/completions", json=CHAT),
    Route("GET", "/v1/files"),
    Route("POST", "/v1/files", upload=True),
    Route("POST", "/v1/files/upload", upload=True),
    Route("POST", "/v1/files/uploads", json={"filename": "note.txt", "bytes": 13, "purpose": "assistants"}),
    Route("GET", "/v1/user/memory"),
    Route("DELETE", "/v1/user/memory"),
    Route("PUT", "/v1/user/memory/settings", json={"enabled": True}),
    Route("POST", "/v1/moderations", json={"input": "hello"}),
    Route("GET", "/v1/models/{model}"),
]


@pytest.fixture(scope="module")
def engine():
    """One engine for both servers (each runs it in its own AsyncEngine thread, one at a time)."""
    from fairway.assembly import ServerOptions, build_engine

    return build_engine(ServerOptions(max_model_len=512))


def _redis() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        missing("Redis", f"nothing answers at {REDIS_URL}: {exc}")
    finally:
        client.close()


@pytest.fixture(scope="module", params=["memory+sqlite", "redis+postgresql"])
def server(request, engine, tmp_path_factory):
    """A server whose user test-user-1 owns a conversation with a finished reply (and its usage)."""
    from redis_keys import delete_prefixed

    from fairway.assembly import ServerOptions, embedded_app

    keys = [*TEST_KEYS, (REVOKED_KEY, "revoked-user", "paid")]
    options = ServerOptions(max_model_len=512, api_keys=keys, auth_cache_s=0.1)
    at_scale = request.param == "redis+postgresql"
    with temporary_database() if at_scale else contextlib.nullcontext() as pg_url:
        if at_scale:
            _redis()
            if pg_url is None:
                missing("PostgreSQL", f"nothing answers at {PG_HOST}")
            options.redis, options.namespace = REDIS_URL, f"test:{uuid.uuid4().hex[:12]}:"
            options.database = pg_url
        else:
            options.database = f"sqlite:///{tmp_path_factory.mktemp('authz') / 'fairway.db'}"
        app = embedded_app(options, engine)
        server = ThreadServer(app).start()
        server.gateway = app.state.gateway
        try:
            wait_ready(server.url)
            server.ids = _owned_by_user_1(server)
            _revoke(server)
            yield server
        finally:
            server.stop()
            if at_scale:
                asyncio.run(delete_prefixed(REDIS_URL, options.namespace))


def _owned_by_user_1(server) -> dict[str, str]:
    body = {**CHAT, "messages": [{"role": "user", "content": "My name is Alice. Say hi."}], "message_id": MESSAGE_ID}
    completion = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers(), timeout=60).json()
    ids = {"conversation_id": completion["conversation_id"], "reply_id": completion["id"], "message_id": MESSAGE_ID,
           "model": MODEL}
    # A file and a memory of theirs.
    uploaded = httpx.post(f"{server.url}/v1/files/upload", files={"file": ("mine.txt", b"Alice's notes.", "text/plain")},
                          headers=headers(), timeout=60)
    assert uploaded.status_code == 200, uploaded.text
    ids["file_id"] = uploaded.json()["file_id"]
    extracted = httpx.post(f"{server.url}/v1/user/memory/extract", headers=headers(), timeout=120,
                           json={"conversation_id": ids["conversation_id"], "use_model": False})
    assert extracted.status_code == 200 and extracted.json()["memories"], extracted.text
    ids["memory_id"] = extracted.json()["memories"][0]["memory_id"]
    # Its usage is recorded (the route the matrix asks about must have something to hide).
    wait_for(lambda: httpx.get(f"{server.url}/v1/replies/{ids['reply_id']}", headers=headers(),
                               timeout=10).json()["usage"])
    return ids


def _revoke(server) -> None:
    """A key that worked, then was revoked (`fairway keys revoke` does the same)."""
    from fairway.gateway.keys import revoke

    assert httpx.get(f"{server.url}/v1/models", headers=headers(REVOKED_KEY), timeout=10).status_code == 200
    assert server.call(revoke(server.gateway.store, REVOKED_KEY)) is not None
    wait_for(lambda: httpx.get(f"{server.url}/v1/models", headers=headers(REVOKED_KEY),
                               timeout=10).status_code == 401, timeout=10)


def _label(route: Route) -> str:
    return f"{route.method} {route.path} {route.json or route.params or ''}"


def test_the_tables_cover_every_route_that_needs_a_key():
    from fairway.gateway import create_app

    schema = create_app(None).openapi()  # type: ignore[arg-type]
    secured = {(method.upper(), path) for path, ops in schema["paths"].items() for method, op in ops.items()
               if op.get("security")}
    assert secured == {(r.method, r.path) for r in OWNED + UNOWNED}
    public = {"/health", "/ready", "/metrics", "/", "/web/{name}"}  # probes, metrics, the page: no data of anyone's
    assert public | {p for _, p in secured} == set(schema["paths"])


@pytest.mark.parametrize("key", [None, REVOKED_KEY], ids=["no-key", "revoked-key"])
def test_without_a_valid_key_every_route_is_401(server, key):
    for route in OWNED + UNOWNED:
        response = route.send(server, key, server.ids)
        assert response.status_code == 401, (_label(route), response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["message"], _label(route)
        assert response.headers["www-authenticate"].startswith("Bearer")
    # The owner's key still works: the 401s were about the key.
    assert OWNED[0].send(server, API_KEY, server.ids).status_code == 200


def test_another_users_things_do_not_exist_for_them(server):
    ids = server.ids
    for route in OWNED:
        response = route.send(server, OTHER_KEY, ids)
        assert response.status_code == 404, (_label(route), response.text)
        assert set(response.json()) == {"error"}, _label(route)  # nothing of the thing itself
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], _label(route)
    # Nothing of the owner's changed: the conversation is still there, its reply still finished.
    conversation = OWNED[0].send(server, API_KEY, ids).json()
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert OWNED[2].send(server, API_KEY, ids).json()["state"] == "FINISHED"
    assert httpx.get(f"{server.url}/v1/files/{ids['file_id']}", headers=headers(), timeout=10).status_code == 200
    memories = httpx.get(f"{server.url}/v1/user/memory", headers=headers(), timeout=10).json()["memories"]
    assert ids["memory_id"] in {m["memory_id"] for m in memories}


def test_routes_that_name_nothing_show_another_user_only_their_own(server):
    ids = server.ids
    listed = UNOWNED[1].send(server, OTHER_KEY, ids).json()
    assert ids["conversation_id"] not in {c["id"] for c in listed["data"]}
    assert UNOWNED[2].send(server, OTHER_KEY, ids).json()["user"] == OTHER_USER
    assert [m["id"] for m in UNOWNED[0].send(server, OTHER_KEY, ids).json()["data"]] == [MODEL]
    theirs = UNOWNED[3].send(server, OTHER_KEY, ids).json()
    assert theirs["conversation_id"] != ids["conversation_id"] and theirs["id"] != ids["reply_id"]
    # The owner sees their own conversation and usage.
    assert ids["conversation_id"] in {c["id"] for c in UNOWNED[1].send(server, API_KEY, ids).json()["data"]}
    assert UNOWNED[2].send(server, API_KEY, ids).json()["totals"]["requests"] >= 1
