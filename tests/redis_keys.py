"""Test helper: remove every key a test wrote under its own prefix on the real Redis server."""

from __future__ import annotations


async def delete_prefixed(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
