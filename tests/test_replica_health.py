"""The replica's health endpoint (fairway/replica/health.py) over real HTTP, as the fleet's local
backend and Kubernetes' preStop use it: /ready follows the drain, POST /drain starts it (a GET
does not: a probe must never drain a replica), a garbage request gets nothing and no crash."""

from __future__ import annotations

import asyncio

import httpx

from fairway.replica.health import HealthServer


async def test_drain_through_the_health_endpoint():
    draining = asyncio.Event()
    server = HealthServer(lambda: not draining.is_set(), drain=draining.set)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/ready")).status_code == 200
            assert (await client.get("/drain")).status_code == 405 and not draining.is_set()
            assert (await client.post("/drain")).status_code == 202 and draining.is_set()
            assert (await client.get("/ready")).status_code == 503
            assert (await client.get("/health")).status_code == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"\x00\x01garbage\r\n\r\n")
        await writer.drain()
        assert b"404" in await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await server.close()


async def test_no_drain_callback_no_drain_route():
    server = HealthServer(lambda: True)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.post("/drain")).status_code == 404
    finally:
        await server.close()


async def test_the_health_port_serves_the_replicas_prometheus_metrics():
    """One port for a replica: what Prometheus scrapes (the replica.yaml annotation) comes from
    the health server, in the exposition format, with the engine's metrics in it."""
    from prometheus_client.parser import text_string_to_metric_families

    from fairway.usage import metrics

    metrics.GENERATION_TOKENS.labels("smollm2", "paid").inc(3)
    server = HealthServer(lambda: True)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            response = await client.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=")
        families = {family.name: family for family in text_string_to_metric_families(response.text)}
        tokens = {s.labels["model"]: s.value for s in families["fairway:generation_tokens"].samples
                  if s.name.endswith("_total")}
        assert tokens["smollm2"] >= 3
    finally:
        await server.close()
