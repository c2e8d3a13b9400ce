"""Saving finished replies in the conversation store.

Two writers, one outcome: the gateway relaying a reply saves it as soon as it sees the final
event (so the client's next turn finds it in the history), and every gateway runs a
ReplyRecorder that saves the replicas' reports (so a reply nobody watched is saved too). The
store's finish_reply is first-writer-wins, so whichever comes second changes nothing; a recorder
in the process whose relay saved the reply knows it (launched.py) and does not send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable

from fairway.conversation.launched import LaunchedReplies
from fairway.conversation.store import ConversationStore, Ending, NotFound, ReplyFinished
from fairway.domain import STATUS_OF_STATE, ReplyState
from fairway.relay import Delivery, FinalEvent, Inbox, RelayError, TokenLog
from fairway.replica.report import REPORTS_INBOX, ReplyReport
from fairway.tools.record import CallRecord, stored_tools, transcript

log = logging.getLogger(__name__)

def _ending(reply_id: str, text: str, final: FinalEvent, tools: list[CallRecord] | None = None) -> Ending | None:
    """What finish_reply stores for this final event; None for a reply that ends without a message."""
    state = ReplyState(str(final.state))
    if state not in STATUS_OF_STATE:
        return None
    return Ending(reply_id, text, STATUS_OF_STATE[state], "error" if final.error else final.finish_reason,
                  final.prompt_tokens, final.completion_tokens, final.cached_tokens, final.n, stored_tools(tools or []),
                  list(final.categories) or None)


async def save_final(store: ConversationStore, reply_id: str, text: str, final: FinalEvent,
                     tools: list[CallRecord] | None = None) -> bool:
    """Store the reply's message with its status, counts and tool calls. False if it was saved
    already (by the other writer), ended without a message (shed) or is not in the store."""
    ending = _ending(reply_id, text, final, tools)
    try:
        if ending is None:
            await store.update_reply(reply_id, state=ReplyState(str(final.state)), last_event_id=final.n)
            return False
        saved = await store.finish_reply(
            reply_id, text, ending.status, ending.finish_reason, prompt_tokens=ending.prompt_tokens,
            completion_tokens=ending.completion_tokens, cached_tokens=ending.cached_tokens,
            last_event_id=ending.last_event_id, look_up_existing=False, tools=ending.tools,
            flagged_categories=ending.flagged_categories)
        return saved is not None
    except (ReplyFinished, NotFound):
        return False


async def save_from_log(store: ConversationStore, token_log: TokenLog, reply_id: str) -> bool:
    """Save a reply whose log holds its final event, with the text of the whole log."""
    events = await token_log.read(reply_id)
    if not events or not isinstance(events[-1], FinalEvent):
        return False
    text, tools = transcript(events)
    return await save_final(store, reply_id, text, events[-1], tools)


class ReplyRecorder:
    """Takes the replicas' reports from their inbox and writes them to the store.

    In batches: it takes what has come in during linger_s (up to batch_max reports) at once, so a
    busy gateway marks its started replies in one round trip and hands its ended ones to the
    hooks together (accounting: one read of their jobs, one write of their usage), instead of a
    round trip or three per report. A report is recorded at most linger_s later for it. A batch's
    acknowledgement goes with the next batch's second look at the inbox, not in a round trip of
    its own.

    At least once: a batch is acknowledged only once the store and the hooks have taken it. One
    that failed (the database away for a moment), or whose gateway died meanwhile, is taken again
    retry_after_s later by whichever recorder looks first (each looks every reclaim_every_s),
    one report at a time; a report that still fails after max_attempts is logged and dropped.
    Everything it does is idempotent (the store's first writer wins, usage is stored once per
    reply and only a newly stored record settles limits), so doing it twice changes nothing."""

    def __init__(self, store: ConversationStore, inbox: Inbox, *, batch_max: int = 64, linger_s: float = 0.02,
                 retry_after_s: float = 30.0, reclaim_every_s: float = 5.0, max_attempts: int = 5,
                 consumer: str | None = None, launched: LaunchedReplies | None = None) -> None:
        self.store = store
        # The replies this process launched (its gateway's): one its relay saved needs no write.
        self.launched = LaunchedReplies() if launched is None else launched
        self.inbox = inbox
        self.batch_max = batch_max
        self.linger_s = linger_s
        self.retry_after_s = retry_after_s
        self.reclaim_every_s = reclaim_every_s
        self.max_attempts = max_attempts
        self.consumer = consumer or f"recorder-{uuid.uuid4().hex[:12]}"  # this process's, in the inbox
        self._next_reclaim = 0.0  # loop time
        self._done: list[Delivery] = []  # recorded, not yet acknowledged (see _next)
        # Run after a batch of finished reports is saved (usage records, quota settlement): each
        # report is taken by one gateway's recorder (again only if it was not acknowledged).
        self.on_finished: list[Callable[[list[ReplyReport]], Awaitable[None]]] = []

    async def run(self) -> None:
        try:
            while True:
                try:
                    deliveries = await self._next()
                    if deliveries and deliveries[0].attempts > 1:
                        for delivery in deliveries:  # (alone: one bad report must not hold up the rest)
                            self._done += await self._record([delivery])
                    elif deliveries:
                        self._done += await self._record(deliveries)
                except RelayError:
                    log.warning("reports inbox unavailable; recorder retrying", exc_info=True)
                    await asyncio.sleep(1.0)
                except Exception:  # (an inbox refusing a command): the recorder must outlive it
                    log.exception("recorder failed; retrying")
                    await asyncio.sleep(1.0)
        finally:  # stopped: what it recorded is not taken again by another gateway in retry_after_s
            with contextlib.suppress(Exception):
                await self._acknowledge()

    async def _next(self) -> list[Delivery]:
        """Reports left unacknowledged for retry_after_s, if it is time to look for them; else new
        ones (waiting until the next look at most). The batch recorded before is acknowledged with
        the second look at the new ones (one round trip), or before the look for reclaimable ones:
        at most reclaim_every_s after it was recorded, well within retry_after_s."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_reclaim:
            self._next_reclaim = loop.time() + self.reclaim_every_s
            await self._acknowledge()
            reclaimed = await self.inbox.reclaim(REPORTS_INBOX, self.consumer, min_idle_s=self.retry_after_s,
                                                 max_count=self.batch_max)
            if reclaimed:
                return reclaimed
        taken = await self.inbox.take(REPORTS_INBOX, self.consumer, max_count=self.batch_max,
                                      timeout=max(0.01, self._next_reclaim - loop.time()))
        if taken and len(taken) < self.batch_max and self.linger_s > 0:
            await asyncio.sleep(self.linger_s)
            done, self._done = self._done, []  # (if the look fails, they are taken again later)
            taken += await self.inbox.take(REPORTS_INBOX, self.consumer, max_count=self.batch_max - len(taken),
                                           timeout=0, acked=done)
        elif taken:
            await self._acknowledge()
        return taken

    async def _acknowledge(self) -> None:
        done, self._done = self._done, []
        await self.inbox.ack(REPORTS_INBOX, done)

    async def _record(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Record the reports: those to acknowledge (all of them, or none: left to be taken again)."""
        reports = []
        for delivery in deliveries:
            try:
                reports.append(ReplyReport.from_dict(delivery.item))
            except Exception:  # not a report: acknowledged below, never retried
                log.exception("could not read report %r", delivery.item)
        try:
            await self.record_many(reports)
        except Exception:
            if deliveries[0].attempts < self.max_attempts:
                log.warning("could not record %d reports; they are taken again in %.0f s", len(deliveries),
                            self.retry_after_s, exc_info=True)
                return []
            log.exception("giving up on reports after %d attempts: %r", deliveries[0].attempts,
                          [d.item for d in deliveries])
        return deliveries

    async def record_many(self, reports: list[ReplyReport]) -> None:
        """Write the reports (a report's own bad data is logged and skipped). Every step runs
        even if one before it failed; then the first failure is raised. The steps' statements
        share one database connection (up to four a batch: the hooks' too)."""
        async with self.store.one_connection():
            await self._record_many(reports)
        self.launched.forget(r.reply_id for r in reports if r.kind == "finished")

    async def _record_many(self, reports: list[ReplyReport]) -> None:
        failed: list[Exception] = []

        async def step(write: Awaitable[object]) -> None:
            try:
                await write
            except Exception as exc:
                failed.append(exc)

        # A reply's final state is final (the store ignores later marks and saves): one that this
        # process's relay saved already needs none of them.
        placed = [r for r in reports if not self.launched.saved(r.reply_id)]
        # A failover's "resumed" comes before the new replica's "started" of the same reply.
        requeued = [(r.reply_id, r.replica_id) for r in placed if r.kind == "resumed"]
        if requeued:
            await step(self.store.mark_requeued_many(requeued))
        started = [(r.reply_id, r.replica_id) for r in placed if r.kind == "started"]
        if started:
            await step(self.store.mark_running_many(started))
        finished = [r for r in reports if r.kind == "finished"]
        endings = []
        for report in finished:
            try:
                final = _final_of(report)
                ending = _ending(report.reply_id, report.text, final, report.tools)
            except Exception:
                log.exception("could not record report %r", report)
                continue
            if ending is None:  # (shed: no message)
                await step(save_final(self.store, report.reply_id, report.text, final))
            elif not self.launched.saved(report.reply_id):
                endings.append(ending)
        if endings:
            # Mostly saved already by the gateways that relayed them: one round trip finds that out.
            await step(self.store.finish_replies(endings))
        if finished:
            for hook in self.on_finished:
                await step(hook(finished))
        if failed:
            raise failed[0]


def _final_of(report: ReplyReport) -> FinalEvent:
    return FinalEvent(
        report.last_event_id,
        report.finish_reason or "stop",  # type: ignore[arg-type]
        ReplyState(report.state),
        report.prompt_tokens,
        report.cached_tokens,
        report.completion_tokens,
        report.error,
        tuple(report.categories),
    )
