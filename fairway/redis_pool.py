"""One way to open a Redis client for every part that talks to Redis (token log, limits, registry).

redis-py's default pool fails a command outright ("Too many connections") once 100 are in use,
which a burst reaches easily: a replica appending for hundreds of replies, a gateway admitting a
crowd. A blocking pool makes the burst queue for a connection instead, for at most `wait_s`; past
that the command fails with a ConnectionError, which each part turns into its own "unavailable".
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry


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
