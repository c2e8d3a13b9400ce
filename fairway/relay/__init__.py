"""Relay: each reply's token log (numbered events, kept minutes), the reply bus and inboxes.

make_token_log(None) gives the in-process backend for the embedded server; a redis:// URL gives
the Redis backend shared by many gateway and replica processes. Callers only see TokenLog.
"""

from __future__ import annotations

from typing import Any

from fairway.relay.bus import DEFAULT_QUEUE, LANE_ORDER, ClaimedJob, Lane, ReplyBus
from fairway.relay.errors import (
    EventIdOutOfRange,
    EventOutOfOrder,
    RelayError,
    RelayUnavailable,
    ReplyFinished,
    ReplyNotFound,
)
from fairway.relay.events import (
    FINISH_REASONS,
    TERMINAL_STATES,
    Event,
    FinalEvent,
    FinishReason,
    ReplyState,
    TokenEvent,
    event_from_fields,
)
from fairway.relay.inbox import Delivery, Inbox
from fairway.relay.memory import InProcessTokenLog
from fairway.relay.token_log import DEFAULT_TTL_S, TokenLog, TokenSink


def make_token_log(url: str | None = None, **options: Any) -> TokenLog:
    """None or "memory://" -> InProcessTokenLog; "redis://" / "rediss://" / "unix://" -> RedisTokenLog.

    options go to the backend (ttl_s for both; prefix, block_s, ... for Redis).
    """
    if url is None or url in ("", "memory://"):
        return InProcessTokenLog(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from fairway.relay.redis_log import RedisTokenLog  # redis is only imported when used

        return RedisTokenLog(url, **options)
    raise ValueError(f"unsupported token log URL {url!r}: use memory:// or redis://host:port/db")


__all__ = [
    "DEFAULT_QUEUE",
    "DEFAULT_TTL_S",
    "FINISH_REASONS",
    "LANE_ORDER",
    "TERMINAL_STATES",
    "ClaimedJob",
    "Delivery",
    "Event",
    "EventIdOutOfRange",
    "EventOutOfOrder",
    "FinalEvent",
    "FinishReason",
    "Inbox",
    "InProcessTokenLog",
    "Lane",
    "RelayError",
    "RelayUnavailable",
    "ReplyBus",
    "ReplyFinished",
    "ReplyNotFound",
    "ReplyState",
    "TokenEvent",
    "TokenLog",
    "TokenSink",
    "event_from_fields",
    "make_token_log",
]
