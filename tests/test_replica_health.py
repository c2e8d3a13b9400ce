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
