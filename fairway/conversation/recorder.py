"""Saving finished replies in the conversation store.

Two writers, one outcome: the gateway relaying a reply saves it as soon as it sees the final
event (so the client's next turn finds it in the history), and every gateway runs a
ReplyRecorder that saves the replicas' reports (so a reply nobody watched is saved too). The
store's finish_reply is first-writer-wins, so whichever comes second changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fairway.conversation.entities import MessageStatus, ReplyState
from fairway.conversation.store import ConversationStore, Ending, NotFound, ReplyFinished
from fairway.relay import ClaimedJob, FinalEvent, RelayError, ReplyBus, TokenEvent, TokenLog
from fairway.replica.report import REPORTS_QUEUE, ReplyReport

log = logging.getLogger(__name__)

STATUS_OF_STATE = {
    ReplyState.FINISHED: MessageStatus.COMPLETE,
    ReplyState.STOPPED: MessageStatus.STOPPED,
    ReplyState.FLAGGED: MessageStatus.FLAGGED,
}


def _ending(reply_id: str, text: str, final: FinalEvent) -> Ending | None:
    """What finish_reply stores for this final event; None for a reply that ends without a message."""
    state = ReplyState(str(final.state))
    if state not in STATUS_OF_STATE:
        return None
    return Ending(reply_id, text, STATUS_OF_STATE[state], "error" if final.error else final.finish_reason,
                  final.prompt_tokens, final.completion_tokens, final.cached_tokens, final.n)


async def save_final(store: ConversationStore, reply_id: str, text: str, final: FinalEvent) -> bool:
    """Store the reply's message with its status and counts. False if it was saved already (by
    the other writer), ended without a message (shed) or is not in the store."""
    ending = _ending(reply_id, text, final)
    try:
        if ending is None:
            await store.update_reply(reply_id, state=ReplyState(str(final.state)), last_event_id=final.n)
            return False
        saved = await store.finish_reply(
            reply_id, text, ending.status, ending.finish_reason, prompt_tokens=ending.prompt_tokens,
            completion_tokens=ending.completion_tokens, cached_tokens=ending.cached_tokens,
            last_event_id=ending.last_event_id, look_up_existing=False)
        return saved is not None
    except (ReplyFinished, NotFound):
        return False


async def save_from_log(store: ConversationStore, token_log: TokenLog, reply_id: str) -> bool:
    """Save a reply whose log holds its final event, with the text of the whole log."""
    events = await token_log.read(reply_id)
    if not events or not isinstance(events[-1], FinalEvent):
        return False
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    return await save_final(store, reply_id, text, events[-1])


class ReplyRecorder:
    """Claims the replicas' reports from the bus and writes them to the store.

    In batches: it takes what has come in during linger_s (up to batch_max reports) at once, so a
    busy gateway marks its started replies in one round trip and hands its ended ones to the
    hooks together (accounting: one read of their jobs, one write of their usage), instead of a
    round trip or three per report. A report is recorded at most linger_s later for it."""

    def __init__(self, store: ConversationStore, bus: ReplyBus, *, batch_max: int = 64,
                 linger_s: float = 0.02) -> None:
        self.store = store
        self.bus = bus
        self.batch_max = batch_max
        self.linger_s = linger_s
        # Run after a batch of finished reports is saved (usage records, quota settlement): each
        # report is claimed by one gateway's recorder, so each runs once per report.
        self.on_finished: list[Callable[[list[ReplyReport]], Awaitable[None]]] = []

    async def run(self) -> None:
        while True:
            try:
                claimed = await self._claim()
            except RelayError:
                log.warning("reply bus unavailable; recorder retrying", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            reports = []
            for job in claimed:
                try:
                    reports.append(ReplyReport.from_dict(job.job))
                except Exception:  # one bad report must not stop the recorder
                    log.exception("could not read report %r", job.job)
            await self.record_many(reports)

    async def _claim(self) -> list[ClaimedJob]:
        claimed = await self.bus.claim_many(queue=REPORTS_QUEUE, max_count=self.batch_max, timeout=None)
        if len(claimed) < self.batch_max and self.linger_s > 0:
            await asyncio.sleep(self.linger_s)
            claimed += await self.bus.claim_many(queue=REPORTS_QUEUE, max_count=self.batch_max - len(claimed),
                                                 timeout=0)
        return claimed

    async def record_many(self, reports: list[ReplyReport]) -> None:
        started = [(r.reply_id, r.replica_id) for r in reports if r.kind == "started"]
        if started:
            try:
                # A reply whose "finished" report (or relaying gateway) got there first stays final.
                await self.store.mark_running_many(started)
            except Exception:
                log.exception("could not mark %d replies running", len(started))
        finished = [r for r in reports if r.kind != "started"]
        if not finished:
            return
        endings = []
        for report in finished:
            try:
                final = _final_of(report)
                ending = _ending(report.reply_id, report.text, final)
                if ending is None:  # (shed: no message)
                    await save_final(self.store, report.reply_id, report.text, final)
                else:
                    endings.append(ending)
            except Exception:
                log.exception("could not record report %r", report)
        try:
            # Mostly saved already by the gateways that relayed them: one round trip finds that out.
            await self.store.finish_replies(endings)
        except Exception:
            log.exception("could not save %d ended replies", len(endings))
        for hook in self.on_finished:
            try:
                await hook(finished)
            except Exception:  # one failing hook must not keep the others from running
                log.exception("a finished-report hook failed for %d replies", len(finished))


def _final_of(report: ReplyReport) -> FinalEvent:
    return FinalEvent(
        report.last_event_id,
        report.finish_reason or "stop",  # type: ignore[arg-type]
        ReplyState(report.state),
        report.prompt_tokens,
        report.cached_tokens,
        report.completion_tokens,
        report.error,
    )
