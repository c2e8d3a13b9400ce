"""The guard every Redis implementation of the relay wraps its calls in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.relay.errors import RelayUnavailable


@contextmanager
def guard() -> Iterator[None]:
    """Transport failures become RelayUnavailable (the gateway answers 503 rather than hang)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise RelayUnavailable(f"Redis unreachable: {exc}") from exc
