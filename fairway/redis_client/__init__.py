"""Every Redis connection Fairway opens, and every fast path for them, in one place.

A part that talks to Redis (the relay's token log, job queue and inbox; the limits; the replica
registry) gets a RedisClient and never builds protocol bytes or reaches into a library itself:

* commands and pipelines go over one multiplexed connection (mux.RedisMux);
* blocking commands (BLMPOP, XREADGROUP BLOCK) wait on connections of their own, one per wait
  in progress, kept for the next (blocking());
* Lua scripts run by their sha, reloaded when Redis lost them (scripts.run_scripts);
* the relay's live events come over a connection handed over raw (connect_raw()), its bytes
  fed to the relay's dispatcher unparsed;
* the redis-py client (redis_py()) is there for the parts whose few commands a pool serves well.

Transport failures surface as redis-py's ConnectionError / TimeoutError; each part turns them
into its own "unavailable" error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from fairway.redis_client.mux import Command, RawConnection, RedisMux, pack
from fairway.redis_client.scripts import Script, pack_call, run_packed_scripts, run_scripts

SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(url: str | None) -> bool:
    return bool(url) and url.startswith(SCHEMES)  # type: ignore[union-attr]


def redis_py(url: str, *, max_connections: int = 64, wait_s: float, connect_timeout_s: float,
             socket_timeout_s: float, retry: Retry | None = None) -> aioredis.Redis:
    """redis-py's client on a blocking pool: a burst queues for a connection (at most wait_s)
    instead of failing outright with "Too many connections" as the default pool does."""
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


class RedisClient:
    """The connections of one part of a process to the Redis at url (see the module docstring).
    block_s bounds one blocking wait on the server, so the socket timeout never fires on it."""

    def __init__(self, url: str, *, connect_timeout_s: float = 2.0, socket_timeout_s: float = 6.0,
                 block_s: float = 1.0, retries: int = 2) -> None:
        self.url = url
        self.block_s = block_s
        self._options = {"connect_timeout_s": connect_timeout_s,
                         "socket_timeout_s": max(socket_timeout_s, block_s + 5.0), "retries": retries}
        self.mux = RedisMux(url, **self._options)
        self._waiting: list[RedisMux] = []  # idle connections for blocking commands
        self._py: aioredis.Redis | None = None

    async def execute(self, *command: Any) -> Any:
        return await self.mux.execute(*command)

    async def batch(self, commands: Sequence[Command]) -> list[Any]:
        return await self.mux.batch(commands)

    async def batch_packed(self, packed: Sequence[bytes]) -> list[Any]:
        return await self.mux.batch_packed(packed)

    async def run_scripts(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        return await run_scripts(self.mux, script, calls)

    async def run_packed_scripts(self, script: Script, calls: Sequence[bytes]) -> list[Any]:
        return await run_packed_scripts(self.mux, script, calls)

    async def blocking(self, command: Callable[[float], list[Any]], timeout: float | None) -> Any:
        """Run a blocking command (command(seconds to wait) builds it) until it returns something
        or the timeout (None: no limit) runs out; None then. It waits on a connection of its own,
        in slices no longer than block_s."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None  # (the blocking read waited until the deadline)
            wait = self.block_s if remaining is None else min(remaining, self.block_s)
            mux = self._waiting.pop() if self._waiting else RedisMux(self.url, **self._options)
            try:
                reply = await mux.execute(*command(max(wait, 0.01)))
            except BaseException:
                await mux.close()  # (cancelled mid-wait, its reply would come to the next caller)
                raise
            self._waiting.append(mux)
            if reply:
                return reply

    async def connect_raw(self, on_data: Callable[[bytes], None]) -> RawConnection:
        """A connection of its own whose bytes go to on_data unparsed (see RedisMux.connect_raw)."""
        return await self.mux.connect_raw(on_data)

    def redis_py(self) -> aioredis.Redis:
        """redis-py's client for the same server (made on first use)."""
        if self._py is None:
            timeout = self._options["socket_timeout_s"]
            self._py = redis_py(self.url, wait_s=timeout, connect_timeout_s=self._options["connect_timeout_s"],
                                socket_timeout_s=timeout, retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 2))
        return self._py

    async def ping(self) -> None:
        await self.mux.execute("PING")

    async def close(self) -> None:
        await self.mux.close()
        for mux in self._waiting:
            await mux.close()
        self._waiting.clear()
        if self._py is not None:
            await self._py.aclose()
            self._py = None


__all__ = ["Command", "RawConnection", "RedisClient", "RedisMux", "Script", "is_redis_url", "pack", "pack_call",
           "redis_py", "run_packed_scripts", "run_scripts"]
