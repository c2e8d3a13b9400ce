"""Failover: the replies of a replica that died (or drained) carry on elsewhere.

Every gateway runs one. Each sweep (every poll_s) it looks at the registry: a replica gone
(its heartbeat expired, or it withdrew) whose queue may still hold work is taken over by one
gateway at a time (ReplicaRegistry.claim_takeover). Every job left in its queue, claimed or still
waiting (JobQueue.unfinished), goes to the FRONT of its lane on a live replica of its model (the
router's choice), marked as a continuation (GenerationJob.attempt), and only then is acknowledged
in the dead queue: a gateway dying midway leaves the rest for the next claimant, so a job is
handed on at least once, and the token log's numbering drops a second copy at its first append.
The new replica reads the reply's log and carries on after its last event (ReplicaWorker.serve):
the client's stream pauses, and goes on with the next event id.

A draining replica (alive, placing nothing more) has only its waiting jobs moved, by the gateway
that claims it as it would claim a gone one: the ones it runs end there or are left for the
takeover once it has withdrawn.

A replica is gone when its announcement expires (the registry's ttl, 2 s), or sooner when its
heartbeats are late (suspect_after_s) and the health probe finds nothing listening at its
endpoint (router/probe.py): the failover withdraws it from the registry for every gateway then.
An announcement can also lapse with its replica alive: Redis restarted, down longer than the ttl,
drops every replica's at once. Taking such a replica over would set a second producer on each of
its replies, so a gone replica whose health endpoint still answers ready (as last announced to
this gateway) is left for lapse_grace_s to announce again; after that it is taken over too (it
lost Redis for good), and its own copies stop at their next append (replica/worker.py).

What the user sees: a pause of about suspect_after_s (the ttl when the probe cannot decide) plus
one sweep plus the new replica's prefill of the context and what was said, then the reply continues; no error, no repeated or
missing text. While no replica of the model is live the jobs stay where they are (the reply
waits) and the next sweep tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from fairway.relay import ClaimedJob, Relay, RelayError
from fairway.relay.job_queue import Part
from fairway.replica.job import GenerationJob, replica_queue
from fairway.replica.registry import ReplicaInfo, ReplicaRegistry
from fairway.replica.report import REPORTS_INBOX, ReplyReport
from fairway.router.probe import is_dead, is_serving
from fairway.router.router import NoReplica, Router

log = logging.getLogger(__name__)


@dataclass
class FailoverSettings:
    poll_s: float = 0.5  # how often the registry is looked at
    takeover_ttl_s: float = 30.0  # a takeover claim's life: another gateway may retry after it
    suspect_after_s: float = 1.0  # an announcement this old (two missed heartbeats) gets probed
    lapse_grace_s: float = 10.0  # how long a gone replica still serving may take to announce again


class Failover:
    def __init__(self, registry: ReplicaRegistry, relay: Relay, router: Router,
                 settings: FailoverSettings | None = None) -> None:
        self.registry = registry
        self.relay = relay
        self.router = router
        self.settings = settings or FailoverSettings()
        self.owner = f"gateway-{uuid.uuid4().hex[:8]}"
        self.handed_on = 0  # jobs this gateway moved (tests, metrics)
        self._seen: dict[str, ReplicaInfo] = {}  # each replica's last announcement this gateway read
        self._gone_since: dict[str, float] = {}  # monotonic: when this gateway first found it gone

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except RelayError:
                log.warning("failover sweep failed (Redis unreachable?); retrying", exc_info=True)
            except Exception:
                log.exception("failover sweep failed; retrying")
            await asyncio.sleep(self.settings.poll_s)

    async def sweep(self) -> int:
        """One look: hand on the work of gone replicas and what waits at draining ones; the
        number of jobs moved."""
        moved = 0
        live = await self.router.live(refresh=True)
        if await self._probe_late(live):
            live = await self.router.live(refresh=True)
        for info in live:
            self._seen[info.id] = info
            self._gone_since.pop(info.id, None)
            # One gateway at a time moves a draining replica's waiting jobs, as it takes a gone one
            # over: two sweeps reading the same waiting jobs would each hand every one on.
            if info.draining and await self.registry.claim_takeover(info.id, self.owner,
                                                                    self.settings.takeover_ttl_s):
                moved += await self._move(info.id, "waiting")
        for replica_id in await self.registry.gone():
            if await self._lapsed(replica_id):
                continue  # alive: it announces again on its next heartbeat
            if not await self.registry.claim_takeover(replica_id, self.owner, self.settings.takeover_ttl_s):
                continue  # another gateway is on it
            left = await self._take_over(replica_id)
            moved += left[0]
            if left[1]:
                await self.relay.jobs.delete(queue=replica_queue(replica_id))
                await self.registry.forget(replica_id)
                self._seen.pop(replica_id, None)
                self._gone_since.pop(replica_id, None)
        return moved

    async def _lapsed(self, replica_id: str) -> bool:
        """Whether a gone replica is in fact alive and serving, its announcement merely lapsed,
        and still within lapse_grace_s of this gateway finding it gone."""
        info = self._seen.get(replica_id)
        if info is None:
            return False  # never seen alive here (this gateway started after it went): no endpoint to ask
        now = time.monotonic()
        since = self._gone_since.setdefault(replica_id, now)
        if now - since > self.settings.lapse_grace_s or not await is_serving(info):
            return False
        if since == now:
            log.warning("replica %s: its announcement lapsed but it still serves (Redis restarted?); "
                        "waiting up to %.0f s for it to announce again", replica_id, self.settings.lapse_grace_s)
        return True

    async def _probe_late(self, live: list[ReplicaInfo]) -> bool:
        """Withdraw the replicas whose heartbeats are late and whose health endpoint nobody
        listens at any more; whether there were any."""
        now = time.monotonic()
        late = [r for r in live if self.registry.ttl_s - (r.expires_at - now) > self.settings.suspect_after_s]
        dead = [r for r, gone in zip(late, await asyncio.gather(*(is_dead(r) for r in late)), strict=True) if gone]
        for info in dead:
            log.warning("replica %s: heartbeats late and nothing listens at %s; failing it over",
                        info.id, info.health_url)
            await self.registry.withdraw(info.id)
        return bool(dead)

    async def _take_over(self, replica_id: str) -> tuple[int, bool]:
        """(jobs moved, whether the queue is empty now)."""
        moved = await self._move(replica_id, "all")
        left = await self.relay.jobs.unfinished(queue=replica_queue(replica_id))
        return moved, not left

    async def _move(self, replica_id: str, part: Part) -> int:
        queue = replica_queue(replica_id)
        jobs = await self.relay.jobs.unfinished(queue=queue, part=part)
        moved = 0
        for claimed in jobs:
            try:
                if not await self._hand_on(claimed, replica_id):
                    break  # no replica for it now: the next sweep tries again
            except NoReplica:
                break
            moved += 1
            await self.relay.jobs.ack([claimed], queue=queue)
        if moved:
            log.info("failover: %d jobs of replica %s handed on", moved, replica_id)
            self.handed_on += moved
        return moved

    async def _hand_on(self, claimed: ClaimedJob, replica_id: str) -> bool:
        """Submit the job to a live replica, at the front of its lane; False if there is none.
        A job that is not one (malformed) is dropped: True."""
        try:
            job = GenerationJob.from_dict(claimed.job)
        except (KeyError, TypeError, ValueError):
            log.error("failover: dropping malformed job %r of replica %s", claimed.job, replica_id)
            return True
        target = await self.router.place(job.model, job.prompt_token_ids)
        if target.id == replica_id:
            return False
        job.attempt += 1
        await self.relay.jobs.submit(job.to_dict(), job.lane, queue=target.queue, front=True)
        try:
            await self.relay.inbox.post(REPORTS_INBOX, ReplyReport("resumed", job.reply_id, target.id).to_dict())
        except RelayError:  # the store's replica id is only informative; the new replica's start corrects it
            log.warning("failover: could not report reply %s resumed", job.reply_id)
        return True

