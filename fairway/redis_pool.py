"""One way to open a Redis client for every part that talks to Redis (token log, limits, registry),
and run_scripts, which pipelines a script's calls over a part's RedisMux (the per-request hot path).

redis-py's default pool fails a command outright ("Too many connections") once 100 are in use,
which a burst reaches easily: a replica appending for hundreds of replies, a gateway admitting a
crowd. A blocking pool makes the burst queue for a connection instead, for at most `wait_s`; past
that the command fails with a ConnectionError, which each part turns into its own "unavailable".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from fairway.redis_mux import RedisMux, pack


def redis_client(url: str, *, max_connections: int = 64, wait_s: float, connect_timeout_s: float,
                 socket_timeout_s: float, retry: Retry | None = None) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=wait_s,
        decode_responses=True,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=socket_timeout_s,
        retry=retry,
    )
    return aioredis.Redis.from_pool(pool)  # from_pool: aclose() closes the pool too


async def run_scripts(mux: RedisMux, script: AsyncScript,
                      calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
    """Run script once per (keys, args), all in one pipelined round trip on mux; a call that failed
    has its error in its place. Reloads the script if Redis lost it (a restart, SCRIPT FLUSH): such
    calls did not run, so running them again is safe. Transport errors are raised."""
    return await run_packed_scripts(mux, script, [script_call(script, keys, args) for keys, args in calls])


def script_call(script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    """One call of script, packed: run_packed_scripts() takes a list of them."""
    return pack(["EVALSHA", script.sha, len(keys), *keys, *args])


async def run_packed_scripts(mux: RedisMux, script: AsyncScript, calls: Sequence[bytes]) -> list[Any]:
    """run_scripts() of calls packed by script_call() (a caller that repeats them packs them once)."""
    if not calls:
        return []
    results = await mux.batch_packed(calls)
    lost = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
    if lost:
        await mux.execute("SCRIPT", "LOAD", script.script)
        for i, result in zip(lost, await mux.batch_packed([calls[i] for i in lost]), strict=True):
            results[i] = result
    return results
