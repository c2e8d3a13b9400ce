"""At a reply's end: its usage record, and the token reservation it made settled.

Runs as a hook of the ReplyRecorder, which claims each replica report in exactly one gateway, so
every reply is accounted once however many gateways there are; it takes the recorder's batches
whole. The usage records go in first: a record's unique reply_id makes a report delivered twice (a
restarted reply) a no-op for the quota too.

What the gateway knew at admission travels with the reply, in the stored job's "meta": the user,
the tier, the reservation (window key, bucket, tokens), the idempotency key and the single-flight
fingerprint.

Single flight: identical requests share one generation, but each is a request, billed as OpenAI
bills each request. The leader's is the reply's record; each follower that receives the reply's
end gets a record of its own (`shared`), keyed by the reply and the follower's request, with the
reply's usage (what its response's `usage` says); one whose client left first, a record of its
prompt and the completion tokens it was sent. A follower reserves its tokens as any request does
and the gateway settles them to that bill (gateway/chat.py, Edge.follow). The token metrics count
the generation once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fairway.conversation import ConversationStore, UsageRecord
from fairway.conversation.entities import new_id, now
from fairway.conversation.launched import LaunchedReplies
from fairway.limits import Limits, LimitsError, Reservation, WindowState
from fairway.relay import FinalEvent
from fairway.replica.report import ReplyReport
from fairway.usage import metrics
from fairway.usage.pricing import Pricing

log = logging.getLogger(__name__)


def utc_day(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def reservation_meta(reservation: Reservation) -> dict[str, Any]:
    return {"key": reservation.key, "bucket": reservation.bucket, "tokens": reservation.tokens}


def reservation_from_meta(user: str, model: str, tier: str, quota: dict[str, Any]) -> Reservation:
    return Reservation(user, model, tier, int(quota["tokens"]), WindowState(0, 0, 0.0), int(quota["bucket"]),
                       str(quota["key"]))


def _failed(report: ReplyReport) -> bool:
    """A failed or shed reply is not billed."""
    return report.error is not None or report.state == "SHED"


class Accounting:
    def __init__(self, store: ConversationStore, limits: Limits, pricing: Pricing,
                 launched: LaunchedReplies | None = None) -> None:
        self.store = store
        self.launched = LaunchedReplies() if launched is None else launched  # jobs this process stored: not read back
        self.limits = limits
        self.pricing = pricing

    async def on_finished(self, reports: list[ReplyReport]) -> None:
        """Account a batch of ended replies (the recorder's): one read of their jobs (none for
        the ones this process launched), one write of their usage records, then each one's
        limits settled."""
        jobs = await self.launched.jobs(self.store, [report.reply_id for report in reports])
        ts = now()
        records: list[UsageRecord] = []
        ends: list[tuple[dict[str, Any], str, str, str, ReplyReport, bool]] = []
        seen: set[str] = set()
        for report in reports:
            if report.reply_id in seen:
                continue  # delivered twice in one batch: once is all it counts
            seen.add(report.reply_id)
            job = jobs.get(report.reply_id)
            meta: dict[str, Any] = (job or {}).get("meta") or {}
            user = meta.get("user")
            if not job or not user:
                continue  # not submitted through the edge (a test, or a reply from before keys)
            model = str(job.get("model", ""))
            tier = str(meta.get("tier") or "")
            failed = _failed(report)
            records.append(self._record(report.reply_id, user, model, tier, report, failed, ts))
            ends.append((meta, user, model, tier, report, failed))
        if not records:
            return
        stored = await self.store.add_usage_many(records)
        for meta, user, model, tier, report, failed in ends:
            if report.reply_id not in stored:
                continue  # accounted already
            # Counted here, once per reply over the whole fleet (a report delivered twice stores one
            # record), where the reply's end is known for certain: its finish reason as the replica said it.
            metrics.observe_success(model, report.finish_reason, report.error is not None)
            try:
                await self._close(meta, user, model, tier, report, failed)
            except LimitsError:
                # The reservation ages out of its window within a minute: over-counted, never under.
                log.warning("reply %s: could not settle its limits", report.reply_id, exc_info=True)

    async def shared(self, reply_id: str, request_id: str, user: str, tier: str, model: str, final: FinalEvent,
                     duration_s: float) -> None:
        """Bill a request that followed another's generation (single flight) with the usage its
        response reported; request_id tells it apart from the reply's own record."""
        usage = ReplyReport("finished", reply_id, "", state=str(final.state), finish_reason=str(final.finish_reason),
                            prompt_tokens=final.prompt_tokens, cached_tokens=final.cached_tokens,
                            completion_tokens=final.completion_tokens, error=final.error, duration_s=duration_s)
        await self.store.add_usage_many([self._record(f"{reply_id}+{request_id}", user, model, tier, usage,
                                                      _failed(usage), now())])

    def _record(self, key: str, user: str, model: str, tier: str, report: ReplyReport, failed: bool,
                ts: float) -> UsageRecord:
        return UsageRecord(
            id=new_id("usage"),
            reply_id=key,
            user_id=user,
            model=model,
            tier=tier,
            prompt_tokens=report.prompt_tokens,
            cached_tokens=report.cached_tokens,
            completion_tokens=report.completion_tokens,
            ttft_s=report.ttft_s,
            duration_s=report.duration_s,
            finish_reason="error" if report.error else (report.finish_reason or report.state.lower()),
            # A failed or shed reply is not billed (and its reservation is released by on_finished).
            cost=0.0 if failed else self.pricing.cost(model, report.prompt_tokens, report.cached_tokens,
                                                      report.completion_tokens),
            created_at=ts,
            day=utc_day(ts),
        )

    async def _close(self, meta: dict[str, Any], user: str, model: str, tier: str, report: ReplyReport,
                     failed: bool) -> None:
        quota = meta.get("quota")
        if quota:
            reservation = reservation_from_meta(user, model, tier, quota)
            if failed:
                await self.limits.tokens.release(reservation)
            else:
                await self.limits.tokens.settle(reservation, report.prompt_tokens + report.completion_tokens)
        if meta.get("idempotency_key"):
            await self.limits.idempotency.complete(user, meta["idempotency_key"])
        if meta.get("flight"):
            await self.limits.flights.finish(meta["flight"], report.reply_id)
