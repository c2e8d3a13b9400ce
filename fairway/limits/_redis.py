"""The Redis client the limits share, and the guard that turns transport failures into
LimitsUnavailable. Nothing here blocks server-side, so short socket timeouts are safe."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.limits.errors import LimitsUnavailable
from fairway.redis_client import RedisClient, Script


def connect(url: str, *, connect_timeout_s: float = 0.5, socket_timeout_s: float = 1.0) -> RedisClient:
    # One quick retry rides out a blip; beyond that the caller gets LimitsUnavailable.
    return RedisClient(url, connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s, retries=1)


async def run(client: RedisClient, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """One call of script: its reply, or its error raised."""
    (result,) = await client.run_scripts(script, [(keys, args)])
    if isinstance(result, Exception):
        raise result
    return result


@contextmanager
def guard() -> Iterator[None]:
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:  # OSError covers TimeoutError
        raise LimitsUnavailable(f"Redis unreachable: {exc}") from exc


def part(value: str) -> str:
    """A key component with ':' (and '{', '}': Cluster hash tags) escaped, so 'a:b' + 'c' and
    'a' + 'b:c' can never name the same key."""
    return quote(str(value), safe="")


def clock_arg(clock: Callable[[], float] | None) -> str:
    """ARGV for the scripts' clock: '' = the server's TIME (one clock for every gateway)."""
    return "" if clock is None else repr(float(clock()))


# Lua prologue: `now` from ARGV[i] when a test injects a clock, else the server's clock.
def now_from(argv_index: int) -> str:
    return (
        f"local now = tonumber(ARGV[{argv_index}])\n"
        "if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end\n"
    )
