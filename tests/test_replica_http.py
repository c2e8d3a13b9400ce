"""The replica's own HTTP port (fairway/replica/http.py) over real HTTP: /ready follows the
worker (503 until announced, 503 again once draining), POST /drain starts the drain, /metrics is
Prometheus's text; anything else a plain 404 or 405, a garbage request no crash."""

from __future__ import annotations

import asyncio

import httpx

from fairway.replica.http import serve_http


async def test_ready_live_metrics_and_drain():
    state = {"ready": False, "draining": False}
    drained = asyncio.Event()

    def drain() -> None:
        state.update(ready=False, draining=True)
        drained.set()

    server = await serve_http("127.0.0.1", 0, lambda: (state["ready"], state["draining"]), drain)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            loading = await client.get("/ready")
            assert (loading.status_code, loading.json()) == (503, {"ready": False, "draining": False})
            state["ready"] = True
            assert (await client.get("/ready")).json() == {"ready": True, "draining": False}
            assert (await client.get("/live")).status_code == 200
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200 and "fairway:time_to_first_token_seconds" in metrics.text
            assert (await client.get("/drain")).status_code == 405  # a probe must not drain it
            assert (await client.post("/ready")).status_code == 405
            assert (await client.get("/nope")).status_code == 404
            assert (await client.post("/drain")).status_code == 202 and drained.is_set()
            after = await client.get("/ready")
            assert (after.status_code, after.json()) == (503, {"ready": False, "draining": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00\x01garbage\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on, nothing else
        writer.close()
        async with httpx.AsyncClient() as client:  # and it still serves
            assert (await client.get(f"http://127.0.0.1:{port}/live")).status_code == 200
    finally:
        server.close()
        await server.wait_closed()
