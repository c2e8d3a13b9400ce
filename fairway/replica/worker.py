"""The replica worker: claims jobs, runs them on the engine, writes each token to the token log
(the tokens of all its replies from one engine step together, in one round trip).

Each reply's text passes the output check (fairway/safety/) here, where its tokens enter the
token log, so every listener and every resumed stream sees the same events: the current sentence
is held back until it is checked, and a flagged one is never appended; the reply ends at once
(finish_reason content_filter, state FLAGGED) and keeps the text released before it.

Jobs are delivered at least once: the worker acknowledges a job when its reply has ended, so a
replica that dies leaves its claimed jobs in its queue for a failover (fairway/router/failover.py)
to hand to another replica, which carries the reply on after the tokens already in its log
(serve). Of two producers of one reply (a failover raced a slow replica) the second fails at its
first append and drops the reply without a word: the client sees one reply. Likewise of two runs
of one reply (its log was lost and a gateway ran it again: GenerationJob.run): the earlier run's
appends are refused by the later run's log and it drops the reply, and a job of the later run
that reaches a replica still running the earlier one replaces it there (serve). SIGTERM drains
(drain): the replica leaves routing, finishes what it can within a grace period and leaves the
rest, unacknowledged and with their tokens logged, for a failover to carry on elsewhere.

Per reply it also honours Stop (from any gateway, through the token log's stop requests) and
cancels replies nobody has listened to for idle_cancel_s. Either way the engine drops the
sequence at its next step and frees its blocks, and the text so far is kept (state STOPPED).
When a reply ends, the final event goes to the log (listeners see it at once) and a report goes
to the recorders, which save it in the conversation store.

A reply with tools (its job's `tools`) runs its output through the call parser (fairway/tools/):
a client-defined call becomes a tool event and ends the reply with finish_reason tool_calls; an
execute_code call pauses it (a tool event, status running), runs in the sandbox, and the reply
goes on here as a new engine request continuing the same prompt (fairway/tools/loop.py), its
events numbered on, up to the job's bound on tool rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import statistics
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

from fairway.domain import LANE_ORDER, PRIORITY_OF_LANE, Lane, Priority, ToolStatus
from fairway.engine import AsyncEngine, EngineDead, FinishReason, RequestOutput, SamplingParams
from fairway.relay import (
    ClaimedJob,
    EventOutOfOrder,
    FinalEvent,
    LogReplaced,
    Relay,
    RelayError,
    RelayUnavailable,
    ReplyFinished,
    ReplyNotFound,
    ReplyState,
    RunReplaced,
    TokenEvent,
    TokenLog,
    ToolEvent,
)
from fairway.replica.health import HealthServer
from fairway.replica.job import GenerationJob, replica_queue
from fairway.replica.logprobs import token_logprobs
from fairway.replica.prefix_summary import DEFAULT_CAPACITY, PrefixSummary
from fairway.replica.registry import DEFAULT_REGION, ReplicaInfo, ReplicaRegistry
from fairway.replica.report import REPORTS_INBOX, ReplyReport
from fairway.replica.seats import Seats
from fairway.safety import HoldBack, ModerationResult, Moderator, OutputMode
from fairway.sandbox import Sandbox, SandboxLimits
from fairway.tools import ToolSet
from fairway.tools.grammar import call_grammar
from fairway.tools.loop import ToolLoop, new_call_id
from fairway.tools.parser import ParsedCall
from fairway.tools.prompt import render_call
from fairway.tools.record import CallRecord, add_event, transcript
from fairway.usage import metrics

log = logging.getLogger(__name__)

# handoff: a drain ran out of time; the reply is left for another replica to carry on. replaced:
# a job of a later run of the reply came here (its log was lost and made again): that run owns it.
CancelCause = Literal["stop", "idle", "shutdown", "handoff", "replaced"]
T = TypeVar("T")
SANDBOX_RECHECK_BEATS = 30  # heartbeats between two looks at a sandbox that was off
SEAT_RECHECK_S = 0.1  # every seat taken: how long a claim of paid work waits before looking for a freed seat
TTFT_WINDOW_S = 30.0  # the heartbeat's TTFT p99 is over the replies of this last while


@dataclass
class ReplicaSettings:
    model: str
    replica_id: str = field(default_factory=lambda: f"replica-{uuid.uuid4().hex[:8]}")
    idle_cancel_s: float = 30.0  # nobody listening this long cancels the reply
    idle_check_s: float = 1.0  # how often listeners are checked
    heartbeat_s: float = 0.5  # registry announcements; the registry's ttl (2 s) is a few of these
    region: str = field(default_factory=lambda: os.environ.get("FAIRWAY_REGION") or DEFAULT_REGION)
    prefix_summary_blocks: int = DEFAULT_CAPACITY  # cached blocks the heartbeat describes (most recent)
    max_inflight: int = 256  # jobs claimed at once (paid work beyond them: seats.py); the rest wait in the queue
    output_mode: OutputMode = "check-then-release"  # the output check's (when the worker has a moderator)
    max_sentence_chars: int = 300
    sandbox_limits: SandboxLimits = field(default_factory=SandboxLimits)  # each execute_code run's
    drain_grace_s: float = 30.0  # SIGTERM: how long the replies in flight get to finish here
    # The health endpoint (replica/health.py): port 0 takes a free one, None serves none.
    health_host: str = "127.0.0.1"
    health_port: int | None = None
    mini_of: str = ""  # the main model whose mini pool this replica serves ("": a main-pool replica)
    background_max_wait_s: float | None = 30.0  # background work queued this long is claimed first (seats.py)


class _Appender:
    """Appends from all of this replica's replies that come in the same loop iteration (one
    engine step's tokens) go to the token log together, in one round trip (append_many),
    instead of a round trip per token."""

    def __init__(self, token_log: TokenLog) -> None:
        self._log = token_log
        self._pending: list[tuple[str, TokenEvent | ToolEvent, int | None, asyncio.Future[int]]] = []
        self._writes: set[asyncio.Task] = set()  # strong references to batches in flight

    def append(self, reply_id: str, event: TokenEvent | ToolEvent, run: int | None = None) -> asyncio.Future[int]:
        """Append one event of the reply's run `run` (its job's); the future gets its n. (A plain
        function returning the future, not a coroutine: a coroutine's frame more for every token
        of every reply.)"""
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush)  # after the replies woken with this one have appended too
        done: asyncio.Future[int] = loop.create_future()
        self._pending.append((reply_id, event, run, done))
        return done

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._write(batch))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, batch: list[tuple[str, TokenEvent | ToolEvent, int | None, asyncio.Future[int]]]) -> None:
        items = [(reply_id, event) for reply_id, event, _, _ in batch]
        runs = [run for _, _, run, _ in batch]
        try:
            results = await _through_outages(lambda: self._log.append_many(items, runs), "append tokens")
        except Exception as exc:  # an outage longer than the retries fails every append of the batch
            for _, _, _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        except BaseException:  # cancelled (shutdown): so are the appends waiting for it
            for _, _, _, done in batch:
                done.cancel()
            raise
        for (reply_id, event, _, done), result in zip(batch, results, strict=True):
            if done.done():
                continue  # its reply was cancelled meanwhile
            if isinstance(result, EventOutOfOrder) and 0 < event.n <= result.last_n \
                    and await self._logged(reply_id, event):
                result = event.n  # written by a try that lost its answer to an outage
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)

    async def _logged(self, reply_id: str, event: TokenEvent | ToolEvent) -> bool:
        """Whether the log's event number event.n is this very event: a try the connection lost
        (retried here, or by the Redis client itself) had written it. Anything else there was
        written by another producer of the reply. (Read only on such a conflict: rare.)"""
        try:
            logged = await self._log.read(reply_id, event.n - 1)
        except RelayError:
            return False
        return bool(logged) and logged[0] == event


@dataclass
class _Running:
    job: GenerationJob
    cancelled: CancelCause | None = None
    events: int = 0  # n of the last event written
    text: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)  # wall clock: the job's submission, else its claim
    first_token_at: float | None = None
    last_token_at: float | None = None  # monotonic, for inter-token latency
    inter_token: Any = None  # its histogram's child for the job's model and tier: labels() per token costs
    resumed_at: int = 0  # n of the last event logged before this replica took the reply on
    request_id: str = ""  # the engine request of the current round (a tool run starts a new one)
    chars: int = 0  # of text so far: where the next tool call is made
    tools: list[CallRecord] = field(default_factory=list)  # its tool calls, as the conversation stores them
    client_called: bool = False  # it made a client-defined call: the reply ends with tool_calls
    interrupted: ToolEvent | None = None  # a failover's: a run its log shows started and never ended
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # serve() is done with it (a later run waits)


@dataclass
class _Round:
    """How one engine request of a reply ended."""

    last: RequestOutput | None = None
    generated: list[int] = field(default_factory=list)  # its tokens (the next round's prompt goes on from them)
    flagged: ModerationResult | None = None
    call: ParsedCall | None = None  # a call this replica answers (execute_code): run it, then go on
    calls_done: bool = False  # the client's calls are made and the model went on to other text: end here


@dataclass
class _Counts:
    """A reply's usage over its rounds: the first prompt plus each tool result; every token generated."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0

    def add(self, first: bool, out: RequestOutput | None) -> None:
        if out is None:
            return
        if first:
            self.prompt, self.cached = out.num_prompt_tokens, out.num_cached_tokens
        self.completion += out.num_output_tokens

    def usage(self) -> tuple[int, int, int]:
        return self.prompt, self.cached, self.completion


class ReplicaWorker:
    def __init__(
        self, engine: AsyncEngine, relay: Relay, registry: ReplicaRegistry, settings: ReplicaSettings,
        moderator: Moderator | None = None, sandbox: Sandbox | None = None,
    ) -> None:
        self.engine = engine
        self.sandbox = sandbox  # execute_code's; None: the tool is off here
        self._sandbox_off = "this replica has no sandbox" if sandbox is None else "not checked yet"
        self._rechecking: asyncio.Task | None = None
        self.relay = relay
        self.moderator = moderator  # None: no output check
        self.registry = registry
        self.settings = settings
        self.queue = replica_queue(settings.replica_id)
        self._running: dict[str, _Running] = {}
        self._appender = _Appender(relay.log)
        self._seats = Seats(settings.max_inflight, settings.background_max_wait_s)
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._stopping = False  # stop() has begun: the loops' cancellations are its own
        self.draining = False
        self._claiming: asyncio.Future[ClaimedJob | None] | None = None  # the claim loop's wait
        self._started_at = time.time()
        self._ttfts: deque[float] = deque(maxlen=64)  # of the latest replies: the heartbeat's median
        self._recent_ttfts: deque[tuple[float, float]] = deque(maxlen=512)  # (monotonic, TTFT): its p99
        self._queued = 0  # its queue's depth at the last heartbeat
        self._drain_task: asyncio.Task | None = None  # a drain POST /drain started
        self._claimed = 0  # new jobs claimed since start (the heartbeat's arrivals, with the queue's depth)
        self._summary: tuple[tuple[int, ...], PrefixSummary] | None = None  # (of these hashes, summary)
        self._health = None if settings.health_port is None else \
            HealthServer(lambda: not (self.draining or self._stopping), settings.health_host,
                         settings.health_port, self.request_drain)
        engine.recent_blocks_limit = settings.prefix_summary_blocks  # what the engine's snapshot keeps

    @property
    def id(self) -> str:
        return self.settings.replica_id

    def request_drain(self) -> None:
        """Drain as SIGTERM does, from the health endpoint's POST /drain (Kubernetes' preStop);
        run() returns once drained."""
        if not self.draining and self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self.drain())  # (a strong reference)

    def info(self, queued: dict[Lane, int] | None = None) -> ReplicaInfo:
        """The announcement: queued is its queue's depth per lane (waiting, with what it claimed
        and has not started)."""
        engine = self.engine.engine
        running: dict[str, int] = {}
        waiting = {str(lane): n for lane, n in (queued or {}).items() if n}
        if queued is not None:
            self._queued = sum(queued.values())  # an announcement without it keeps the last (arrived)
        for job in self._running.values():
            lanes = running if job.first_token_at is not None else waiting
            lanes[job.job.lane] = lanes.get(job.job.lane, 0) + 1
        stats = self.engine.last_stats
        return ReplicaInfo(
            id=self.id,
            model=self.settings.model,
            queue=self.queue,
            max_model_len=engine.max_model_len,
            max_prompt_tokens=engine.max_prompt_tokens,
            load=sum(running.values()) + sum(waiting.values()),
            capacity=self.settings.max_inflight,
            sandbox_off=self._sandbox_off,
            draining=self.draining,
            started_at=self._started_at,
            region=self.settings.region,
            running=running,
            waiting=waiting,
            free_kv_blocks=stats.kv_blocks_total - stats.kv_blocks_used,
            kv_blocks=stats.kv_blocks_total,
            ttft_s=statistics.median(self._ttfts) if self._ttfts else None,
            drain_rate=self._seats.drain_rate(),
            mini_of=self.settings.mini_of,
            ttft_p99_s=self._recent_p99(),
            arrived=self._claimed + self._queued,
            block_size=engine.kv.block_size,
            prefix=self._prefix_summary(),
            health_url=self._health.url if self._health is not None and self._health.port else "",
        )

    def _recent_p99(self) -> float | None:
        """The TTFT p99 of the replies of the last TTFT_WINDOW_S: a slow one a while ago must not
        keep a fleet manager adding replicas."""
        since = time.monotonic() - TTFT_WINDOW_S
        while self._recent_ttfts and self._recent_ttfts[0][0] < since:
            self._recent_ttfts.popleft()
        return _p99([ttft for _, ttft in self._recent_ttfts])

    def _prefix_summary(self) -> PrefixSummary:
        """The engine's latest snapshot of its cached blocks, summarised once per snapshot."""
        blocks = self.engine.recent_blocks
        if self._summary is None or self._summary[0] is not blocks:
            self._summary = (blocks, PrefixSummary.of(blocks, self.settings.prefix_summary_blocks))
        return self._summary[1]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Announce the replica and start its loops; returns at once. Drained before it started
        (a SIGTERM while the model loaded: a fleet scaling down, a spot reclaim), it never starts:
        run() then returns at once."""
        if self.draining:
            return
        self._stopping = False
        self.engine.start()
        if self._health is not None:
            await self._health.start()
        await self._check_sandbox()
        metrics.ENGINES.track(self.id, self.settings.model, self.engine)
        await self.registry.announce(self.info())
        await self._resume_own()
        if self.draining or self._stopping:
            # Drained (or stopped) while it started: a SIGTERM just after the announcement, as a
            # fleet's replacement meets. stop() found no loops to end; started now, they would serve
            # for ever. None start, and an announcement that landed after stop()'s withdrawal goes.
            with contextlib.suppress(Exception):
                await self.registry.withdraw(self.id)
            if self._drain_task is not None:  # (POST /drain's: run() returns once drained)
                await self._drain_task
            return
        for loop in (self._claim_loop, self._stop_loop, self._idle_loop, self._heartbeat_loop):
            self._loops.append(asyncio.create_task(self._supervised(loop), name=f"{self.id}:{loop.__name__}"))

    async def run(self) -> None:
        """start() and serve until cancelled, or until drain() (or stop()) ends the loops."""
        await self.start()
        try:
            await asyncio.gather(*self._loops)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is None or me.cancelling():
                raise  # this task was cancelled; otherwise stop() ended the loops: a normal end
        finally:
            await self.stop()

    async def drain(self) -> None:
        """Leave routing and stop claiming at once (announced as draining: routers place nothing
        more here, a failover moves what still waits in the queue), give the replies in flight
        drain_grace_s to end here, then hand the rest on: each stops where its log is, its job
        left unacknowledged, and once the replica has withdrawn a gateway's failover carries it on
        elsewhere. Then stop. The clients see a pause, no error."""
        self.draining = True
        if self._claiming is not None:
            self._claiming.cancel()  # the claim loop's wait: the loop then ends (run() goes on)
        with contextlib.suppress(Exception):
            await self.registry.announce(self.info())
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.settings.drain_grace_s)
        handed = list(self._running)
        for reply_id in handed:
            self._cancel(reply_id, "handoff")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if handed:
            log.info("drained: %d replies handed on to other replicas", len(handed))
        await self.stop()

    async def stop(self) -> None:
        """Leave routing, end the replies in flight (their clients get a final event), stop."""
        self._stopping = True
        with contextlib.suppress(Exception):
            await self.registry.withdraw(self.id)
        metrics.ENGINES.untrack(self.id)
        for loop in self._loops:
            loop.cancel()
        if self._rechecking is not None:
            self._rechecking.cancel()
        for reply_id in list(self._running):
            self._cancel(reply_id, "shutdown")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop
        self._loops.clear()
        if self._health is not None:
            await self._health.close()

    async def _supervised(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run one of the worker's loops for as long as the worker runs: one that fails, or is
        cancelled by anything but stop() (a connection lost under it can surface as a
        cancellation), starts again, so a Redis outage never ends a replica quietly. A loop that
        returns has ended by design (the claim loop, on drain)."""
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if self._stopping or (me is not None and me.cancelling()):
                    raise
                log.error("replica %s: %s was cancelled under it; starting it again", self.id, loop.__name__)
            except Exception:
                log.exception("replica %s: %s failed; starting it again", self.id, loop.__name__)
            await asyncio.sleep(0.5)

    async def _resume_own(self) -> None:
        """Restarted under the same id before a failover took its queue over: the jobs its last
        run claimed and did not finish (still pending in its queue) carry on here, each as a
        continuation after what its log holds, as a failover would have handed them on."""
        try:
            left = await self.relay.jobs.unfinished(queue=self.queue, part="claimed")
        except RelayError:
            log.warning("could not look for jobs a previous run left; a failover hands them on", exc_info=True)
            return
        for claimed in left:
            job = {**claimed.job, "attempt": int(claimed.job.get("attempt", 0)) + 1}
            self._seat(dataclasses.replace(claimed, job=job))
        if left:
            log.info("replica %s: carrying on %d replies its previous run left", self.id, len(left))

    # -- loops -------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while not self.draining:
            lanes = self._seats.open_lanes()  # claim only what we can run: the rest stays for others
            if not lanes:
                await self._seats.freed()
                continue
            # Every seat taken: paid work only, in short waits, so a seat freed meanwhile is seen.
            timeout = None if len(lanes) == len(LANE_ORDER) else SEAT_RECHECK_S
            self._claiming = asyncio.ensure_future(self.relay.jobs.claim(queue=self.queue, timeout=timeout,
                                                                         lanes=lanes))
            try:
                claimed = await self._claiming
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if self.draining and me is not None and not me.cancelling():
                    return  # drain() stopped the claims, not a cancel of this loop
                raise
            # A claim that fails (Redis away for a moment) ends the loop: _supervised starts it
            # again shortly; nothing is held between claims, no seat was taken for it.
            if claimed is None:
                continue
            if not claimed.job.get("attempt"):  # a failover's continuation arrived once already
                self._claimed += 1
            self._seat(claimed)

    def _seat(self, claimed: ClaimedJob) -> None:
        """Serve a claimed job in a seat of its lane, given back when its reply has ended."""
        taken_at = self._seats.take(claimed.lane)
        task = asyncio.create_task(self._serve_claimed(claimed))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._done(done, claimed.lane, taken_at))

    def _done(self, task: asyncio.Task, lane: Lane, taken_at: float) -> None:
        self._tasks.discard(task)
        self._seats.give(lane, taken_at)

    async def _stop_loop(self) -> None:
        while True:
            try:
                async for reply_id in self.relay.log.watch_stops():
                    if reply_id in self._running:
                        self._cancel(reply_id, "stop")
            except RelayError:
                log.warning("stop watch interrupted; retrying", exc_info=True)
                await asyncio.sleep(1.0)

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.idle_check_s)
            reply_ids = list(self._running)
            try:
                idles = await self.relay.log.listener_idle_many(reply_ids)  # one round trip for all
            except RelayError:
                continue
            for reply_id, idle in zip(reply_ids, idles, strict=True):
                if idle is not None and idle >= self.settings.idle_cancel_s:
                    log.info("reply %s: nobody listening for %.0f s, cancelling", reply_id, idle)
                    self._cancel(reply_id, "idle")

    async def _heartbeat_loop(self) -> None:
        beats = 0
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            beats += 1
            if self._sandbox_off and self.sandbox is not None and beats % SANDBOX_RECHECK_BEATS == 0 \
                    and (self._rechecking is None or self._rechecking.done()):
                # A sandbox service that was down may be back; asked aside: the beat must not wait on it.
                self._rechecking = asyncio.create_task(self._check_sandbox())
            try:
                depth = await self.relay.jobs.depth(queue=self.queue)
                self._seats.waiting(depth)
                await self.registry.announce(self.info(depth))
            except Exception:  # a blip must not kill the replica; the next beat retries
                log.warning("heartbeat failed", exc_info=True)

    async def _check_sandbox(self) -> None:
        """Whether execute_code runs here (the registry tells gateways), and if not why."""
        if self.sandbox is None:
            return
        was = self._sandbox_off
        self._sandbox_off = await self.sandbox.check() or ""
        if self._sandbox_off and self._sandbox_off != was:
            log.warning("execute_code is off on replica %s: %s", self.id, self._sandbox_off)

    def _cancel(self, reply_id: str, cause: CancelCause) -> None:
        running = self._running.get(reply_id)
        # replaced overrides an earlier cause: whatever it meant to end with, the log is no longer its own
        if running is not None and (running.cancelled is None or cause == "replaced"):
            running.cancelled = cause
            # The engine drops it at the next step and frees its blocks (between tool rounds there
            # is none: the reply ends when its tool run does).
            self.engine.abort(running.request_id or reply_id)

    # -- one reply ---------------------------------------------------------------------------

    async def _serve_claimed(self, claimed: ClaimedJob) -> None:
        try:
            job = GenerationJob.from_dict(claimed.job)
        except (KeyError, TypeError, ValueError):
            log.error("dropping malformed job %r", claimed.job)
            await self._ack(claimed)
            return
        try:
            await self.serve(job, claimed)
        except Exception:
            log.exception("reply %s failed", job.reply_id)
            await self._ack(claimed)

    async def _ack(self, claimed: ClaimedJob) -> None:
        try:
            await self.relay.jobs.ack([claimed], queue=self.queue)
        except RelayError:  # it may run again elsewhere after a failover: its first append then fails
            log.warning("could not acknowledge job %s", claimed.id, exc_info=True)

    async def serve(self, job: GenerationJob, claimed: ClaimedJob | None = None) -> bool:
        """Generate one reply into its token log, then report how it ended, and acknowledge
        claimed (the job's queue entry) with the report. False when the reply is left for
        another replica (a drain's handoff): its job stays unacknowledged."""
        while (other := self._running.get(job.reply_id)) is not None:
            if job.run is None or other.job.run is None or job.run <= other.job.run:
                log.warning("reply %s is already running here; ignoring the duplicate job", job.reply_id)
                return True
            # A later run: the reply's log was lost and made again for it. The run going here
            # never learnt that; it gives way (its appends would be refused anyway), and this one
            # runs once it has left the engine (the engine knows a reply's request by its id).
            log.info("reply %s: run %d replaces run %d running here", job.reply_id, job.run, other.job.run)
            self._cancel(job.reply_id, "replaced")
            await other.ended.wait()
        running = self._running[job.reply_id] = _Running(job)
        if job.submitted_at:
            running.started = min(job.submitted_at, running.started)
        try:
            final = await self._generate(running)
        except Exception:
            # A fault of this replica's own (a bug: the engine's and the relay's errors are handled
            # inside) must not leave the reply's clients waiting for an end that never comes: it
            # ends as an error, with what was said so far.
            log.exception("reply %s failed", job.reply_id)
            final = _failed("the replica failed while generating the reply")
        finally:
            del self._running[job.reply_id]
            running.ended.set()
        if running.cancelled == "handoff":
            return False
        if running.cancelled == "replaced":  # (the later run's serve() said so)
            final = None
        final_n = None if final is None else await self._finish_log(job.reply_id, final, job.run)
        if final is None or final_n is None:  # another producer (or run) has the reply, or it had ended already
            if claimed is not None:
                await self._ack(claimed)
            return True
        await self._report(running, final, final_n, claimed)
        return True

    async def _generate(self, running: _Running) -> FinalEvent | None:
        """The reply's final event; None when it is not this replica's to end."""
        job = running.job
        if await self.relay.log.stop_requested(job.reply_id):  # stopped while it waited in the queue
            return FinalEvent(0, FinishReason.STOP, ReplyState.STOPPED)
        try:
            params = SamplingParams(**job.sampling)
            tools = self._tool_loop(job)
        except (TypeError, ValueError, KeyError) as exc:
            return _failed(f"bad sampling parameters or tools: {exc}")
        generated: list[int] = []
        if job.attempt:
            resumed = await self._resume_point(running, tools)
            if resumed is None:
                return None
            generated = resumed
        await self._report(running, None, 0)
        if running.interrupted is not None and tools is not None:
            event, running.interrupted = running.interrupted, None
            try:
                ran = await self._run_tool(running, tools, ParsedCall(event.name, event.arguments, ""), event.call_id)
            except RunReplaced as exc:
                return _replaced(exc)
            except RelayError as exc:
                return _failed(f"token log: {exc}", None)
            if isinstance(ran, ModerationResult):
                return FinalEvent(0, FinishReason.CONTENT_FILTER, ReplyState.FLAGGED,
                                  categories=tuple(ran.flagged_categories))
            generated += tools.encode(render_call(event.name, event.arguments)) + (ran or [])
        hold = (HoldBack[RequestOutput](self.moderator, self.settings.output_mode, self.settings.max_sentence_chars)
                if self.moderator is not None else None)
        priority = PRIORITY_OF_LANE.get(Lane(job.lane), Priority.FREE)
        prompt, counts, budget = list(job.prompt_token_ids), _Counts(), params.max_tokens
        # tool_choice required or a named function: the first round is held to one well-formed call
        # (guided decoding); after a tool has run, the model answers freely.
        forced = call_grammar(tools.tools) if tools is not None and not running.tools else None
        rounds = 0
        while True:
            running.request_id = job.reply_id if rounds == 0 else f"{job.reply_id}#{rounds}"
            round_params = dataclasses.replace(params, max_tokens=budget)
            if rounds == 0 and forced is not None:
                round_params.guided_decoding = {"lark": forced}
            try:
                # A reply carried on after a failover resumes with what its log holds (_resume_point).
                step = await self._round(running, prompt, round_params, priority, hold, tools,
                                         generated if rounds == 0 else [])
                counts.add(rounds == 0, step.last)
                if step.flagged is None and step.call is None and not step.calls_done and hold is not None \
                        and running.cancelled not in ("shutdown", "handoff", "replaced"):
                    step.flagged = await self._flush(running, hold)  # the last sentence, also of a stopped reply
            except (EngineDead, ValueError) as exc:  # ValueError: RequestRejected (prompt never fits)
                if rounds == 0 and generated and running.events == running.resumed_at \
                        and not isinstance(exc, EngineDead):
                    # A continuation whose context plus what was said no longer fits, or whose words
                    # reach max_tokens already (its replica went before the final event): it ends there.
                    return FinalEvent(0, FinishReason.LENGTH, ReplyState.FINISHED, len(prompt), 0, len(generated))
                return _failed(str(exc), None, counts)
            except EventOutOfOrder:
                # Another producer wrote the event this one meant to (its own lost writes are told
                # apart in _Appender): the reply is that one's now, its end too. A copy that never
                # got to append is a failover racing a slow replica; one overtaken mid-reply, a
                # replica taken over while cut off from Redis (router/failover.py). An error final
                # from here would end the other's stream.
                overtaken = running.events > running.resumed_at
                log.log(logging.WARNING if overtaken else logging.INFO,
                        "reply %s: another replica produces it (from event %d); dropping this copy",
                        job.reply_id, running.events + 1)
                return None
            except RunReplaced as exc:
                return _replaced(exc)
            except RelayError as exc:
                return _failed(f"token log: {exc}", None, counts)
            if step.flagged is not None:
                return FinalEvent(0, FinishReason.CONTENT_FILTER, ReplyState.FLAGGED, *counts.usage(),
                                  categories=tuple(step.flagged.flagged_categories))
            if step.calls_done:
                return FinalEvent(0, FinishReason.TOOL_CALLS, ReplyState.FINISHED, *counts.usage())
            if step.call is None:
                if step.last is None or step.last.finish_reason is None:
                    return _failed("the engine ended the reply without a finish reason", step.last, counts)
                final = _final(step.last, running.cancelled, counts)
                if running.client_called and final.finish_reason == FinishReason.STOP and not running.cancelled:
                    return FinalEvent(0, FinishReason.TOOL_CALLS, ReplyState.FINISHED, *counts.usage())
                return final
            assert tools is not None
            try:
                ids = await self._run_tool(running, tools, step.call)
            except RunReplaced as exc:
                return _replaced(exc)
            except RelayError as exc:
                return _failed(f"token log: {exc}", None, counts)
            if isinstance(ids, ModerationResult):  # the call or its output failed the output check
                return FinalEvent(0, FinishReason.CONTENT_FILTER, ReplyState.FLAGGED, *counts.usage(),
                                  categories=tuple(ids.flagged_categories))
            if ids is None:  # out of tool rounds: the reply said so and ends
                return FinalEvent(0, FinishReason.STOP, ReplyState.FINISHED, *counts.usage())
            if running.cancelled is not None:
                if running.cancelled in ("shutdown", "handoff"):
                    return _failed("the replica shut down", None, counts)
                return FinalEvent(0, FinishReason.STOP, ReplyState.STOPPED, *counts.usage())
            if rounds == 0:
                prompt += generated  # a continuation's earlier tokens came before this round's
            prompt += step.generated + ids
            counts.prompt += len(ids)
            budget -= len(step.generated)
            if budget < 1:
                return FinalEvent(0, FinishReason.LENGTH, ReplyState.FINISHED, *counts.usage())
            rounds += 1

    def _tool_loop(self, job: GenerationJob) -> ToolLoop | None:
        if not job.tools:
            return None
        tokenizer = self.engine.tokenizer
        sandbox = self.sandbox if not self._sandbox_off else None
        return ToolLoop(ToolSet.from_dict(job.tools), sandbox, tokenizer.apply_chat_template, tokenizer.encode,
                        self.settings.sandbox_limits, job.tenant, bool(getattr(tokenizer, "supports_tools", False)))

    async def _round(self, running: _Running, prompt: list[int], params: SamplingParams, priority: Priority,
                     hold: HoldBack[RequestOutput] | None, tools: ToolLoop | None, resumed: list[int]) -> _Round:
        """One engine request of the reply, its tokens released as events (through the call parser
        when the reply has tools), up to its end or a call this replica must answer. resumed: the
        tokens a continuation starts after (the engine counts them as generated)."""
        step = _Round()
        outputs = self.engine.generate(running.request_id, prompt, params, priority, resumed)
        # aclosing: leaving early (a token log failure, a flagged sentence, a tool call) aborts the
        # sequence in the engine now; it leaves the batch at the next step.
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                step.last = out
                if out.token_id is not None:
                    step.generated.append(out.token_id)
                if tools is None:
                    if out.text or (out.token_id is not None and not out.finished):
                        # Every token is an event, even one whose text waits for the rest of a
                        # character; the stop token at the end is not (it has no text).
                        if hold is None:  # (without _append's frame: every await level costs each token)
                            running.events = await self._appender.append(running.job.reply_id,
                                                                         self._token_event(running, out),
                                                                         running.job.run)
                            running.text.append(out.text)
                            running.chars += len(out.text)
                            continue
                        step.flagged = await self._release(running, hold, out)
                        if step.flagged is not None:
                            return step
                    continue
                text, calls = tools.parser.feed(out.text) if out.text else ("", [])
                if out.finished:
                    rest, late = tools.parser.finish(cut=out.finish_reason == FinishReason.LENGTH)
                    text, calls = text + rest, calls + late
                if running.client_called:
                    if text.strip():  # the model went on to other text after its calls: they are the answer
                        step.calls_done = True
                        return step
                elif text or (out.token_id is not None and not out.finished and not tools.parser.buffering):
                    # A token's logprobs go with its own text only: not with text the call parser
                    # held back and releases now, nor with a token whose text a call took.
                    step.flagged = await self._release(running, hold, dataclasses.replace(
                        out, text=text, logprobs=out.logprobs if text == out.text else None))
                    if step.flagged is not None:
                        return step
                for call in calls:
                    step.flagged = await self._flush(running, hold)  # what came before the call goes out first
                    if step.flagged is not None:
                        return step
                    if tools.is_client(call):
                        await self._append_tool(running, ToolEvent(0, new_call_id(), call.name, ToolStatus.CALL,
                                                                   call.arguments, tools.client_calls))
                        tools.client_calls += 1
                        running.client_called = True
                        if not tools.tools.parallel:  # parallel_tool_calls false: this call is the answer
                            step.calls_done = True
                            return step
                    elif running.client_called:  # (a built-in call after the client's: theirs come first)
                        step.calls_done = True
                        return step
                    else:
                        step.call = call
                        return step
        return step

    async def _run_tool(self, running: _Running, tools: ToolLoop, call: ParsedCall,
                        resumed_id: str | None = None) -> list[int] | ModerationResult | None:
        """Run a call this replica answers, between two tool events; the tokens that continue the
        prompt after it, or None when the reply is out of tool rounds (it says so). The code, and
        then its output, pass the output check as the reply's text does: flagged, the result is
        what flagged it, and nothing flagged reaches the log (a flagged output is withheld).
        resumed_id: a run a failover found interrupted, whose running event is logged already."""
        if resumed_id is None:
            if not tools.rounds_left:
                notice = (f"\n\n(This reply reached its limit of {tools.tools.max_rounds} tool runs, so it ends here.)")
                await self._append(running, [RequestOutput(running.job.reply_id, None, notice)])
                return None
            if (flagged := await self._check_tool_text(call.arguments)) is not None:
                return flagged
        call_id = resumed_id or new_call_id()
        if resumed_id is None:
            await self._append_tool(running, ToolEvent(0, call_id, call.name, ToolStatus.RUNNING, call.arguments))
        outcome = await tools.run(call)
        if (flagged := await self._check_tool_text(outcome.output)) is not None:
            await self._append_tool(running, ToolEvent(
                0, call_id, call.name, ToolStatus.FAILED, call.arguments,
                output="(withheld: the output was flagged by the content policy)",
                detail={"flagged": flagged.flagged_categories}))
            return flagged
        await self._append_tool(running, ToolEvent(0, call_id, call.name, outcome.status, call.arguments,
                                                   output=outcome.output, detail=outcome.detail))
        return tools.continuation_ids(outcome.output)

    async def _check_tool_text(self, text: str) -> ModerationResult | None:
        """A tool call's code or output through the output check (once per call, whole)."""
        if self.moderator is None or not text.strip():
            return None
        result = await self.moderator.moderate_one(text, "output")
        return result if result.flagged else None

    async def _release(self, running: _Running, hold: HoldBack[RequestOutput] | None,
                       out: RequestOutput) -> ModerationResult | None:
        """One token's text, through the output check when there is one; the flag if it stopped it."""
        if hold is None:
            await self._append(running, [out])
            return None
        checked = await hold.push(out, out.text)
        await self._append(running, checked.release)
        return checked.flagged

    async def _flush(self, running: _Running, hold: HoldBack[RequestOutput] | None) -> ModerationResult | None:
        """The sentence the output check holds, checked now (before a tool call, at the end)."""
        if hold is None:
            return None
        checked = await hold.finish()
        await self._append(running, checked.release)
        return checked.flagged

    async def _append_tool(self, running: _Running, event: ToolEvent) -> None:
        event = dataclasses.replace(event, n=running.events + 1)
        running.events = await self._appender.append(running.job.reply_id, event, running.job.run)
        add_event(running.tools, event, running.chars)

    async def _resume_point(self, running: _Running, tools: ToolLoop | None) -> list[int] | None:
        """A reply handed on by a failover: what its log holds already (its events carry on after
        them, its text and tool calls start with theirs), as the tokens the model has had so far
        (a reply's tool runs: each call, re-encoded, and its result, as its prompt held them);
        None if it has ended already (its final event is logged). A run that was still going
        when the replica died (running, no outcome) is kept in running.interrupted: it runs again
        here, under the same call id, before the model goes on."""
        reply_id = running.job.reply_id
        try:
            events = await self.relay.log.read(reply_id, run=running.job.run)
        except LogReplaced as exc:  # lost and made again for a later run: that run's producer has it
            _replaced(exc)
            return None
        except ReplyNotFound:  # the log expired: the reply starts over (its first append makes one)
            return []
        if any(isinstance(e, FinalEvent) for e in events):
            return None
        running.events = running.resumed_at = events[-1].n if events else 0
        text, running.tools = transcript(events)
        running.text, running.chars = [e.text for e in events if isinstance(e, TokenEvent)], len(text)
        ids: list[int] = []
        for event in events:
            if isinstance(event, TokenEvent):
                ids += event.token_ids
            elif tools is not None and event.status == ToolStatus.CALL:
                tools.client_calls += 1
                running.client_called = True
            elif tools is not None and event.status == ToolStatus.RUNNING:
                running.interrupted = event
            elif tools is not None and event.status in (ToolStatus.COMPLETED, ToolStatus.FAILED):
                running.interrupted = None
                tools.rounds += 1
                ids += tools.encode(render_call(event.name, event.arguments)) + tools.continuation_ids(event.output)
        return ids

    async def _append(self, running: _Running, outs: Sequence[RequestOutput]) -> None:
        """Append these tokens (released by the output check) as the reply's next events, one
        after another. One event per reply per flush, as without the check: the gateway's fast
        path (a token log callback writing to the connection) broke the SDK's stream when a
        held-back sentence's events arrived in one batch (tests/test_api.py::test_sdk_streaming);
        not yet understood."""
        clock = time.monotonic()  # (latency as listeners see it: a held-back sentence arrives at once)
        for out in outs:
            running.events = await self._appender.append(running.job.reply_id,
                                                         self._token_event(running, out, clock), running.job.run)
            running.text.append(out.text)
            running.chars += len(out.text)

    def _token_event(self, running: _Running, out: RequestOutput, clock: float | None = None) -> TokenEvent:
        """The reply's next event for this token, its latency recorded (clock: when it is
        released, now if None). Explicit numbers: a second producer of this reply (a duplicate
        job) fails instead of interleaving tokens into the same log."""
        clock = time.monotonic() if clock is None else clock
        if running.first_token_at is None:
            running.first_token_at = time.time()
            self._ttfts.append(max(0.0, running.first_token_at - running.started))
            self._recent_ttfts.append((clock, self._ttfts[-1]))
        elif running.last_token_at is not None:
            if running.inter_token is None:
                running.inter_token = metrics.INTER_TOKEN_LATENCY.labels(running.job.model, running.job.tier)
            running.inter_token.observe(clock - running.last_token_at)
        running.last_token_at = clock
        ids = [out.token_id] if out.token_id is not None else []
        if out.logprobs is None:
            return TokenEvent(running.events + 1, out.text, ids)
        return TokenEvent(running.events + 1, out.text, ids, token_logprobs(out.logprobs, self.engine.tokenizer))

    async def _finish_log(self, reply_id: str, final: FinalEvent, run: int | None) -> int | None:
        """The final event's n (0 if it could not be written); None when the log is another
        run's: that run ends the reply, and nothing is reported from here."""
        try:
            return await _through_outages(lambda: self.relay.log.finish(reply_id, final, run), "finish")
        except RunReplaced as exc:
            return _replaced(exc)
        except ReplyFinished:  # a try that lost its answer to an outage had written it
            return await self.relay.log.last_event_id(reply_id)
        except RelayError:
            log.exception("reply %s: could not write its final event", reply_id)
            return 0

    async def _report(self, running: _Running, final: FinalEvent | None, final_n: int,
                      claimed: ClaimedJob | None = None) -> None:
        """Post how the reply went ("started", or "finished" with claimed acknowledged in the same
        round trip)."""
        job = running.job
        if final is None:
            report = ReplyReport("started", job.reply_id, self.id)
        else:
            ended = time.time()
            ttft = None if running.first_token_at is None else max(0.0, running.first_token_at - running.started)
            duration = max(0.0, ended - running.started)
            metrics.observe_reply(job.model, job.tier, ttft, duration, final.prompt_tokens, final.completion_tokens)
            report = ReplyReport(
                "finished",
                job.reply_id,
                self.id,
                text="".join(running.text),
                state=str(final.state),
                finish_reason=final.finish_reason,
                prompt_tokens=final.prompt_tokens,
                completion_tokens=final.completion_tokens,
                cached_tokens=final.cached_tokens,
                last_event_id=final_n,
                error=final.error,
                ttft_s=ttft,
                duration_s=duration,
                tools=running.tools,
                categories=list(final.categories),
            )
        if final is None:  # "started" only marks the reply running, and generation waits for it: one try
            await post_report(self.relay.inbox.post, report, ())
            return
        done = [] if claimed is None else [claimed]
        posted = await post_report(partial(self.relay.conclude, done=done, queue=self.queue), report)
        if not posted and claimed is not None:
            await self._ack(claimed)  # (the report never got through: the reply's job is still done with)


# A Redis restart takes a second or two; a blip, less (the connection itself retries twice).
REPORT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
# Token appends and the final event, the same: the engine goes on generating meanwhile (its
# outputs wait in the reply's stream), and the log catches up once Redis is back.
LOG_RETRY_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)


async def _retrying(call: Callable[[], Awaitable[T]], what: str, delays: Sequence[float],
                   errors: type[Exception] | tuple[type[Exception], ...]) -> T:
    """call(), again after each of delays while it raises one of errors (Redis away for a
    moment); the last error is raised."""
    for delay in (*delays, None):
        try:
            return await call()
        except errors:
            if delay is None:
                raise
            log.warning("%s failed (Redis unreachable?); retrying in %.2f s", what, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def _through_outages(call: Callable[[], Awaitable[T]], what: str) -> T:
    """A token log write, again after each of LOG_RETRY_DELAYS_S while Redis is unreachable."""
    return await _retrying(call, f"token log: {what}", LOG_RETRY_DELAYS_S, RelayUnavailable)


async def post_report(post: Callable[[str, dict[str, Any]], Awaitable[None]], report: ReplyReport,
                      delays: Sequence[float] = REPORT_RETRY_DELAYS_S) -> bool:
    """Post a report to the recorders (post: Inbox.post, or Relay.conclude with the job's
    acknowledgement), retrying after each delay while Redis is unreachable: for a reply nobody
    watched, a "finished" report is the only record of its text and usage. False if it never got
    through."""
    try:
        await _retrying(lambda: post(REPORTS_INBOX, report.to_dict()),
                        f"reply {report.reply_id}: report {report.kind}", delays, RelayError)
        return True
    except RelayError:
        log.exception("reply %s: could not report %s after %d attempts", report.reply_id, report.kind,
                      len(delays) + 1)
        return False


def _replaced(exc: RunReplaced | LogReplaced) -> None:
    """The reply's log holds a later run than this producer's (it was lost and made again): the
    newer run's producer writes it and ends it. This one stops (its engine sequence goes as it
    leaves the round), says so once, and reports nothing: None, as serve() takes it."""
    log.warning("reply %s: its token log holds run %s now, not this replica's run %s; dropping this run",
                exc.reply_id, exc.held, exc.run)


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _usage(out: RequestOutput | None) -> tuple[int, int, int]:
    return (out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens) if out else (0, 0, 0)


def _final(out: RequestOutput, cancelled: CancelCause | None, counts: _Counts | None = None) -> FinalEvent:
    usage = counts.usage() if counts is not None else _usage(out)
    if out.finish_reason == FinishReason.ABORT:  # a cancel that lost the race to the end is no cancel
        if cancelled == "shutdown":
            return _failed("the replica shut down", out, counts)
        # Stop and "nobody listening" both keep the text: finish_reason stop, state STOPPED.
        return FinalEvent(0, FinishReason.STOP, ReplyState.STOPPED, *usage)
    reason = FinishReason.LENGTH if out.finish_reason == FinishReason.LENGTH else FinishReason.STOP
    return FinalEvent(0, reason, ReplyState.FINISHED, *usage)


def _failed(error: str, out: RequestOutput | None = None, counts: _Counts | None = None) -> FinalEvent:
    """An error ends the reply like a stop (the text so far is kept) and says why."""
    usage = counts.usage() if counts is not None and counts.completion else _usage(out)
    return FinalEvent(0, FinishReason.ABORT, ReplyState.STOPPED, *usage, error=error)
