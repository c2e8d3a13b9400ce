"""Routing across real processes: one `fairway gateway` and two `fairway replica` on Redis and
PostgreSQL. A model no replica serves yet is a 503 with Retry-After; a burst of eight streamed
replies spreads over both replicas (the replica ids the store recorded); a request naming a
region, or made with a key whose setting names one, is served there, or elsewhere with a header
saying where."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest
from backends import missing
from pg_admin import temporary_database
from processes import Processes, start_keys
from redis_keys import delete_prefixed
from serving import MODEL, free_port, wait_for, wait_ready

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
KEY: dict[str, str] = {}


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY['key']}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(gateway URL, {region: replica id}): the gateway first, checked with no replica up, then
    a replica in region eu and one in us."""
    namespace = f"test:{uuid.uuid4().hex[:12]}:"
    with temporary_database() as database:
        if database is None:
            missing("PostgreSQL", "nothing answers on the test server")
        procs = Processes(tmp_path_factory.mktemp("procs"))
        shared = ["--redis", REDIS_URL, "--namespace", namespace]
        try:
            keys = start_keys(database, ("router-user", "paid"), ("router-user", "paid", "--region", "us"))
            KEY["database"] = database
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs.start("gateway", "gateway", *shared, "--database", database, "--port", str(port),
                        "--log-level", "warning")
            KEY["key"], KEY["us"] = keys()
            wait_for(lambda: _answers(url), timeout=120)
            no_replica = httpx.post(f"{url}/v1/chat/completions", headers=auth(), timeout=30,
                                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            ids = {"eu": "replica-eu", "us": "replica-us"}
            for region, replica_id in ids.items():
                procs.start(replica_id, "replica", *shared, "--replica-id", replica_id, "--region", region,
                            "--max-model-len", "1024", "--log-level", "warning")
            wait_ready(url, timeout=180)
            wait_for(lambda: _replicas(url) == 2, timeout=120)
        except BaseException:
            procs.stop()
            asyncio.run(delete_prefixed(REDIS_URL, namespace))
            raise RuntimeError(procs.tails()) from None
        yield url, ids, no_replica
        procs.stop()
        asyncio.run(delete_prefixed(REDIS_URL, namespace))


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _replicas(url: str) -> int:
    models = httpx.get(f"{url}/v1/models", headers=auth(), timeout=10).json()["data"]
    return sum(m["replicas"] for m in models)


def test_a_model_no_replica_serves_is_a_503_with_retry_after(fleet):
    _, _, refused = fleet
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "no_replica" and error["type"] == "server_error"
    assert f"No replica is serving model '{MODEL}' right now" in error["message"]


async def _stream(client: httpx.AsyncClient, url: str, content: str, **headers: str) -> tuple[httpx.Headers, list]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers={**auth(), **headers}) as r:
        assert r.status_code == 200, await r.aread()
        events = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    return r.headers, events


def _replica_of(url: str, reply_id: str) -> str:
    return httpx.get(f"{url}/v1/replies/{reply_id}", headers=auth(), timeout=10).json()["replica_id"]


def test_a_burst_of_eight_streams_spreads_over_both_replicas(fleet):
    url, ids, _ = fleet

    async def burst() -> list[tuple[httpx.Headers, list]]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(_stream(client, url, f"Burst {i}: name a colour.") for i in range(8)))

    replies = asyncio.run(burst())
    for _, events in replies:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    placed = [_replica_of(url, h["x-reply-id"]) for h, _ in replies]
    print("burst of 8 placed on:", {i: placed.count(i) for i in set(placed)})
    assert set(placed) == set(ids.values())


def test_a_request_naming_a_region_is_served_there_or_says_where_it_was(fleet):
    url, ids, _ = fleet

    async def run() -> list[tuple[httpx.Headers, list]]:
        async with httpx.AsyncClient(timeout=180) as client:
            return [await _stream(client, url, f"Region check {i}.", **{"X-Fairway-Region": region})
                    for i, region in enumerate(["eu", "us", "eu", "ap-south"])]

    eu, us, eu_again, elsewhere = asyncio.run(run())
    for (h, _), region in ((eu, "eu"), (us, "us"), (eu_again, "eu")):
        assert _replica_of(url, h["x-reply-id"]) == ids[region]
        assert "x-fairway-region-fallback" not in h
    served = elsewhere[0]["x-fairway-region-fallback"]
    assert served in ids and _replica_of(url, elsewhere[0]["x-reply-id"]) == ids[served]
    bad = httpx.post(f"{url}/v1/chat/completions", headers={**auth(), "X-Fairway-Region": "eu west"}, timeout=30,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_region"


def test_a_keys_region_serves_its_requests_unless_they_name_another(fleet):
    url, ids, _ = fleet
    us_key = {"Authorization": f"Bearer {KEY['us']}"}

    async def run() -> list[tuple[httpx.Headers, list]]:
        async with httpx.AsyncClient(timeout=180) as client:
            return [await _stream(client, url, f"Key region {i}.", **us_key, **extra)
                    for i, extra in enumerate([{}, {}, {"X-Fairway-Region": "eu"}])]

    first, second, named = asyncio.run(run())
    assert [_replica_of(url, h["x-reply-id"]) for h, _ in (first, second, named)] == [ids["us"], ids["us"], ids["eu"]]
    assert all("x-fairway-region-fallback" not in h for h, _ in (first, second, named))
    refused = subprocess.run([sys.executable, "-m", "fairway.cli", "keys", "create", "--user", "u", "--region",
                              "eu west", "--database", KEY["database"]], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "a region is 1 to 64 letters" in refused.stderr
