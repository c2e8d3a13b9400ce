"""Every Redis connection Fairway opens, and every fast path for them, in one place.

A part that talks to Redis (the relay's token log, job queue and inbox; the limits; the replica
registry) gets a RedisClient and never builds protocol bytes or reaches into a library itself:

* commands and pipelines go over one multiplexed connection (mux.RedisMux);
* blocking commands (BLMPOP, XREADGROUP BLOCK) wait on connections of their own, one per wait
  in progress, kept for the next (blocking());
* Lua scripts run by their sha, reloaded when Redis lost them (scripts.run_scripts);
* the relay's live events come over a connection handed over raw (connect_raw()), its bytes
  fed to the relay's dispatcher unparsed;
* the same calls work on a single Redis and on a Redis Cluster: the first call asks the server
  (INFO cluster) and, on a cluster, every command goes to the master of its key's slot
  (cluster.ClusterMux); Fairway's keys carry hash tags so that one call never spans slots.

Transport failures surface as redis-py's ConnectionError / TimeoutError; each part turns them
into its own "unavailable" error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry

from fairway.redis_client.cluster import ClusterMux, command_key, runs, slot_groups
from fairway.redis_client.mux import Command, RawConnection, RedisMux, pack
from fairway.redis_client.scripts import (
    Script,
    args_format,
    pack_args,
    pack_call,
    run_packed_scripts,
    run_scripts,
    script_call,
)

Mux = RedisMux | ClusterMux

SCHEMES = ("redis://", "rediss://", "unix://")


def field_pairs(flat: Sequence[Any]) -> dict[Any, Any]:
    """A reply of field-value pairs as Redis sends them (f1, v1, f2, v2 ...: a stream entry's
    fields, XINFO's records) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


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
    """The connections of one part of a process to the Redis (or Redis Cluster) at url (see the
    module docstring). block_s bounds one blocking wait on the server, so the socket timeout never
    fires on it."""

    def __init__(self, url: str, *, connect_timeout_s: float = 2.0, socket_timeout_s: float = 5.0,
                 block_s: float = 1.0, retries: int = 2) -> None:
        self.url = url
        self.block_s = block_s
        self._options = {"connect_timeout_s": connect_timeout_s, "socket_timeout_s": socket_timeout_s,
                         "retries": retries}
        # A blocking command's reply may take block_s: its connection's timeout allows for that.
        self._blocking_options = {**self._options, "socket_timeout_s": block_s + socket_timeout_s}
        self._seed = RedisMux(url, **self._options)
        self._mux: Mux = self._seed  # a ClusterMux once the server said it is a cluster node
        self._known = False  # whether the server was asked
        self._asking = asyncio.Lock()
        self._waiting: dict[str, list[RedisMux]] = {}  # per node url: idle connections for blocking commands

    async def mux(self) -> Mux:
        """The connection commands go over: the single server's, or the cluster's router."""
        if self._known:
            return self._mux
        async with self._asking:
            if not self._known:
                info = await self._seed.execute("INFO", "cluster")
                if "cluster_enabled:1" in str(info):
                    cluster = ClusterMux(self.url, self._seed, lambda url: RedisMux(url, **self._options))
                    await cluster.refresh()
                    self._mux = cluster
                self._known = True
        return self._mux

    @property
    def is_cluster(self) -> bool:
        return isinstance(self._mux, ClusterMux)

    async def execute(self, *command: Any) -> Any:
        return await (self._mux if self._known else await self.mux()).execute(*command)

    async def batch(self, commands: Sequence[Command], *, ordered: bool = False) -> list[Any]:
        """Replies in order, errors in place. On a cluster the commands of different nodes run
        concurrently unless ordered (each node's in order either way)."""
        mux = self._mux if self._known else await self.mux()
        if isinstance(mux, ClusterMux):
            return await mux.batch(commands, ordered=ordered)
        return await mux.batch(commands)

    async def batch_packed(self, packed: Sequence[bytes]) -> list[Any]:
        return await (self._mux if self._known else await self.mux()).batch_packed(packed)

    async def run_scripts(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        return await run_scripts(self._mux if self._known else await self.mux(), script, calls)

    async def run_packed_scripts(self, script: Script, calls: Sequence[bytes]) -> list[Any]:
        return await run_packed_scripts(self._mux if self._known else await self.mux(), script, calls)

    async def script_groups(self, keys: Sequence[str], size: int) -> list[list[int]]:
        """The indices of keys in groups of at most size, in order, for one call per group of a
        script over several items (keys[i] item i's first key): on a single server runs of size;
        on a cluster, whose calls' keys must share a slot, the items of one slot together."""
        mux = self._mux if self._known else await self.mux()
        if isinstance(mux, ClusterMux):
            return slot_groups(keys, size)
        return runs(range(len(keys)), size)

    async def blocking(self, command: Callable[[float], list[Any]], timeout: float | None) -> Any:
        """Run a blocking command (command(seconds to wait) builds it) until it returns something
        or the timeout (None: no limit) runs out; None then. It waits on a connection of its own
        (to its key's node), in slices no longer than block_s."""
        mux = await self.mux()
        node = mux.node_of(command_key(command(1.0))) if isinstance(mux, ClusterMux) else self.url
        idle = self._waiting.setdefault(node, [])
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None  # (the blocking read waited until the deadline)
            wait = self.block_s if remaining is None else min(remaining, self.block_s)
            conn = idle.pop() if idle else RedisMux(node, **self._blocking_options)
            try:
                reply = await conn.execute(*command(max(wait, 0.01)))
            except BaseException:
                await conn.close()  # (cancelled mid-wait, its reply would come to the next caller)
                raise
            idle.append(conn)
            if reply:
                return reply

    async def connect_raw(self, on_data: Callable[[bytes], None], key: str | None = None) -> RawConnection:
        """A connection of its own (to key's node, on a cluster) whose bytes go to on_data
        unparsed (see RedisMux.connect_raw)."""
        mux = await self.mux()
        if isinstance(mux, ClusterMux):
            return await mux.connect_raw(on_data, key)
        return await mux.connect_raw(on_data)

    async def node_of(self, key: str) -> str:
        """Which server holds key: the url of its node (the one server's url if not a cluster)."""
        mux = await self.mux()
        return mux.node_of(key) if isinstance(mux, ClusterMux) else self.url

    async def ping(self) -> None:
        await self.execute("PING")

    async def close(self) -> None:
        await self._seed.close()
        if isinstance(self._mux, ClusterMux):
            await self._mux.close()
        for idle in self._waiting.values():
            for conn in idle:
                await conn.close()
        self._waiting.clear()
        self._mux, self._known = self._seed, False


__all__ = ["ClusterMux", "Command", "RawConnection", "RedisClient", "RedisMux", "Script", "command_key",
           "field_pairs",
           "args_format", "is_redis_url", "pack", "pack_args", "pack_call", "redis_py", "run_packed_scripts",
           "run_scripts", "script_call"]
