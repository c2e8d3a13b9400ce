"""Runs the engine loop in its own thread and gives each request an async iterator of its outputs.

The engine itself is single-threaded: requests and aborts cross into the loop thread through an
inbox, outputs cross back to the caller's event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fairway.domain import Priority
from fairway.engine.llm_engine import LLMEngine, check_continuation
from fairway.engine.outputs import RequestOutput
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.stats import EngineStats

log = logging.getLogger(__name__)

RECENT_BLOCKS_EVERY_S = 0.2  # how stale the snapshot of cached block hashes may get while busy


class EngineDead(RuntimeError):
    """The engine loop failed; requests in flight get this instead of hanging."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    output_token_ids: list[int]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, recent_blocks_limit: int = 4096) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | str | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.last_stats: EngineStats = engine.stats()
        # The hashes of the most recently used cached KV blocks (BlockPool.recent_hashes), taken in
        # the loop thread, where the pool is mutated, and swapped in whole: the replica's
        # heartbeat reads it from its own thread.
        self.recent_blocks_limit = recent_blocks_limit
        self.recent_blocks: tuple[int, ...] = ()
        self._recent_version = -1
        self._recent_at = float("-inf")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fairway-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = Priority.PAID,
                       output_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, the last with a finish reason. Leaving the loop early aborts it.
        output_token_ids: what it generated already elsewhere (LLMEngine.add_request)."""
        if self.error is not None:
            raise EngineDead(f"engine stopped: {self.error}")
        output_token_ids = list(output_token_ids or [])
        self.engine.check_prompt(len(prompt_token_ids) + len(output_token_ids))  # reject now, in the caller
        check_continuation(len(output_token_ids), params)
        self.start()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, priority, output_token_ids))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)
        self._wake.set()

    # --- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                    self.last_stats = self.engine.stats()
                    self._snapshot_recent_blocks(idle=False)
                else:
                    self._snapshot_recent_blocks(idle=True)
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as exc:  # the loop must never die silently: fail every waiting request
            log.exception("engine loop failed")
            self.error = exc
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineDead(f"engine stopped: {exc}"))

    def _snapshot_recent_blocks(self, idle: bool) -> None:
        """At most every RECENT_BLOCKS_EVERY_S while steps run, and once more when the engine
        goes idle, so the last step's blocks are in it; never when nothing changed."""
        pool = self.engine.kv.pool
        now = time.monotonic()
        if pool.version == self._recent_version or (not idle and now - self._recent_at < RECENT_BLOCKS_EVERY_S):
            return
        self.recent_blocks = pool.recent_hashes(self.recent_blocks_limit)
        self._recent_version, self._recent_at = pool.version, now

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            if isinstance(item, str):
                self.engine.abort(item)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.priority,
                                        output_token_ids=item.output_token_ids)
            except Exception as exc:  # one bad request fails alone; the loop serves everyone else
                self._deliver_to(item.request_id, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One hand-over per event loop per step, not one per output: each call_soon_threadsafe
        wakes the loop through its self-pipe (a syscall and a loop turn apiece)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_to(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)
