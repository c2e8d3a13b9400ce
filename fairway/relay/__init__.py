"""Relay: three contracts between gateways and replicas, each with an in-process and a Redis
implementation side by side (token_log*, job_queue*, inbox*):

* the token log: each reply's numbered events, kept minutes, listeners and stop requests;
* the job queue: generation jobs in tier lanes, claimed paid before free before background;
* the inbox: the replicas' reports, held by whoever took them until acknowledged.

make_relay(None) gives the in-process implementations for the embedded server; a redis:// URL
gives the Redis ones, shared by many gateway and replica processes over one RedisClient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fairway.domain import LANE_ORDER, FinishReason, Lane, ReplyState
from fairway.redis_client import RedisClient, is_redis_url
from fairway.relay.errors import (
    EventIdOutOfRange,
    EventOutOfOrder,
    LogReplaced,
    RelayError,
    RelayUnavailable,
    ReplyFinished,
    ReplyNotFound,
    RunReplaced,
)
from fairway.relay.events import Event, FinalEvent, TokenEvent, TokenLogprob, ToolEvent, event_from_fields
from fairway.relay.inbox import Delivery, Inbox
from fairway.relay.inbox_memory import InProcessInbox
from fairway.relay.job_queue import DEFAULT_QUEUE, ClaimedJob, JobQueue
from fairway.relay.job_queue_memory import InProcessJobQueue
from fairway.relay.redis_guard import guard
from fairway.relay.token_log import DEFAULT_TTL_S, RUN_SPAN, TokenLog, TokenSink, raise_if_error
from fairway.relay.token_log_memory import InProcessTokenLog

if TYPE_CHECKING:  # the Redis implementations load when a Redis URL is given (make_relay)
    from fairway.relay.inbox_redis import RedisInbox
    from fairway.relay.job_queue_redis import RedisJobQueue
    from fairway.relay.token_log_redis import RedisTokenLog


@dataclass
class Relay:
    """The three contracts one process uses, on one backend."""

    log: TokenLog
    jobs: JobQueue
    inbox: Inbox

    async def launch(self, reply_id: str, job: dict[str, Any], lane: Lane | str = Lane.FREE, *,
                     queue: str = DEFAULT_QUEUE) -> str:
        """A new reply's start: its log created, then its job submitted (the log first, so
        listeners may attach before token 1). Returns the job id."""
        await self.log.create(reply_id)
        return await self.jobs.submit(job, lane, queue=queue)

    async def conclude(self, inbox: str, item: dict[str, Any], done: Sequence[ClaimedJob], *,
                       queue: str = DEFAULT_QUEUE) -> None:
        """A reply's end at its replica: the report posted to inbox, then the reply's job acked
        (the report first: a job acked without it would leave the reply with no record)."""
        await self.inbox.post(inbox, item)
        await self.jobs.ack(done, queue=queue)

    async def ping(self) -> None:
        """At startup: RelayUnavailable now rather than on the first reply."""

    async def close(self) -> None:
        await self.log.close()
        await self.jobs.close()
        await self.inbox.close()


@dataclass
class RedisRelay(Relay):
    log: RedisTokenLog
    jobs: RedisJobQueue
    inbox: RedisInbox
    client: RedisClient  # the one the three share: launch pipelines the log's and the queue's commands

    async def launch(self, reply_id: str, job: dict[str, Any], lane: Lane | str = Lane.FREE, *,
                     queue: str = DEFAULT_QUEUE) -> str:
        # One pipeline, run in order: the log, then the job (one round trip for a new reply).
        job_id, submit = self.jobs.submit_command(job, lane, queue)
        with guard():
            results = await self.client.batch([self.log.create_command(reply_id), submit],
                                              ordered=True)
        for result in results:
            raise_if_error(result)
        return job_id

    async def conclude(self, inbox: str, item: dict[str, Any], done: Sequence[ClaimedJob], *,
                       queue: str = DEFAULT_QUEUE) -> None:
        # One pipeline, run in order: the report, then the ack (one round trip for a reply's end).
        with guard():
            posted, *acked = await self.client.batch([self.inbox.post_command(inbox, item),
                                                      *self.jobs.ack_commands(done, queue)], ordered=True)
        raise_if_error(posted)
        self.jobs.raise_if_not_acked(acked)

    async def ping(self) -> None:
        with guard():
            await self.client.ping()

    async def close(self) -> None:
        await super().close()
        await self.client.close()


def make_relay(url: str | None = None, *, ttl_s: float = DEFAULT_TTL_S, prefix: str = "fairway:",
               block_s: float = 1.0, connect_timeout_s: float = 2.0, consumer_gone_s: float = 3600.0,
               poll_s: float = 1.0, **log_options: Any) -> Relay:
    """None or "memory://" -> in process; "redis://" / "rediss://" / "unix://" -> Redis.

    block_s: one blocking wait on Redis (and how often live subscribers are swept); poll_s: how
    often an idle in-process subscriber checks its log did not expire; log_options go to the
    Redis token log (heartbeat_s, listener_stale_s, control_maxlen)."""
    if url is None or url in ("", "memory://"):
        return Relay(InProcessTokenLog(ttl_s, poll_s=poll_s), InProcessJobQueue(), InProcessInbox())
    if is_redis_url(url):
        from fairway.relay.inbox_redis import RedisInbox
        from fairway.relay.job_queue_redis import RedisJobQueue
        from fairway.relay.token_log_redis import RedisTokenLog

        client = RedisClient(url, block_s=block_s, connect_timeout_s=connect_timeout_s)
        return RedisRelay(RedisTokenLog(client, ttl_s=ttl_s, prefix=prefix, **log_options),
                          RedisJobQueue(client, prefix=prefix),
                          RedisInbox(client, prefix=prefix, consumer_gone_s=consumer_gone_s), client)
    raise ValueError(f"unsupported relay URL {url!r}: use memory:// or redis://host:port/db")


__all__ = [
    "DEFAULT_QUEUE",
    "DEFAULT_TTL_S",
    "RUN_SPAN",
    "LANE_ORDER",
    "ClaimedJob",
    "Delivery",
    "Event",
    "EventIdOutOfRange",
    "EventOutOfOrder",
    "FinalEvent",
    "FinishReason",
    "InProcessInbox",
    "InProcessJobQueue",
    "InProcessTokenLog",
    "Inbox",
    "JobQueue",
    "Lane",
    "LogReplaced",
    "RedisRelay",
    "Relay",
    "RelayError",
    "RelayUnavailable",
    "ReplyFinished",
    "ReplyNotFound",
    "ReplyState",
    "RunReplaced",
    "TokenEvent",
    "TokenLogprob",
    "ToolEvent",
    "TokenLog",
    "TokenSink",
    "event_from_fields",
    "make_relay",
]
