"""Putting the parts together, the two ways Fairway runs (one code path, different backends):

* embedded (`fairway serve`): one process; the engine in its own thread, token log, bus and
  registry in process, SQLite store. Needs no other server.
* at scale: `fairway gateway` processes (stateless) and `fairway replica` processes (one
  engine each) sharing Redis (token log, bus, registry) and PostgreSQL (store).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairway.models.bundled import BUNDLED_MODEL_NAME, bundled_model_path
from fairway.relay import DEFAULT_TTL_S, Relay, make_relay
from fairway.replica.registry import ReplicaRegistry, make_registry
from fairway.router import RouterSettings
from fairway.safety import SafetySettings, make_moderator
from fairway.sandbox import Sandbox
from fairway.server_gc import settle_heap
from fairway.usage.pricing import Pricing

if TYPE_CHECKING:
    # The engine (torch) is only imported where a replica runs; the gateway's parts (FastAPI, the
    # store's SQLAlchemy, memory, files) only where a gateway runs: a replica process starts without them.
    from fastapi import FastAPI

    from fairway.conversation import ConversationStore
    from fairway.engine import EngineConfig, LLMEngine
    from fairway.files.service import FileService, FileSettings
    from fairway.gateway import GatewayContext
    from fairway.limits import LimitsConfig
    from fairway.memory import MemoryService
    from fairway.models.tokenizer import Tokenizer
    from fairway.replica.worker import ReplicaSettings
    from fairway.retrieval import SqlVectorIndex
    from fairway.router import Router
    from fairway.safety import Moderator

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    """What a server process (embedded, gateway or replica) is built from."""

    model: str | None = None  # a .gguf file or Hugging Face folder; None: the bundled model
    dtype: str = "bfloat16"
    weights: str = "auto"  # how a GGUF's quantized layers are held (models/weights.py)
    device: str = "cpu"
    redis: str | None = None  # None: in-process token log, bus and registry
    database: str | None = None  # None: SQLite under ./.fairway/
    namespace: str = "fairway:"  # Redis key prefix: separate deployments can share one server
    log_ttl_s: float = DEFAULT_TTL_S  # token log retention after a reply's last event
    idle_cancel_s: float = 30.0  # nobody listening this long cancels a reply
    max_model_len: int | None = None  # cap the context window (default: the model's)
    num_kv_blocks: int | None = None
    replica_id: str | None = None
    drain_grace_s: float = 30.0  # a replica's SIGTERM: how long its replies get to end there
    background_max_wait_s: float = 30.0  # background work waiting this long moves up a lane (seats, engine)
    max_inflight: int = 256  # replies a replica claims at once; the rest wait in its queue
    health_host: str = "127.0.0.1"  # a replica process's /health and /ready (replica/health.py)
    health_port: int | None = None  # 0: a free port; None: none
    region: str | None = None  # a replica's region (default: FAIRWAY_REGION, else "local")
    router: RouterSettings = field(default_factory=RouterSettings)  # a gateway's placement
    default_max_tokens: int = 512
    max_tool_rounds: int = 5  # tool runs per reply (execute_code, refused calls); then it ends saying so
    limits: LimitsConfig | None = None  # quotas per tier, admission bounds (default: LimitsConfig())
    pricing: Pricing = field(default_factory=Pricing)  # for the usage records' cost
    # Keys stored at startup if missing, as (key, user, tier): the development key of `fairway
    # serve`, test keys. Other keys come from `fairway keys create`.
    api_keys: list[tuple[str, str, str]] = field(default_factory=list)
    auth_cache_s: float = 5.0  # a valid key is re-checked in the store this often (revocation delay)
    keepalive_s: float | None = None  # an SSE keepalive after this long without events (None: gateway/streaming.py's)
    memory: bool = True  # facts across conversations (off by itself when the embedding model is missing)
    memory_idle_s: float = 300.0  # a conversation idle this long gets its facts extracted
    memory_poll_s: float = 10.0
    memory_extract_tokens: int = 256  # the extraction job's max_tokens
    files: str | None = None  # uploads: a directory (default ./.fairway/files) or s3://bucket
    file_settings: FileSettings | None = None
    safety: SafetySettings = field(default_factory=SafetySettings)  # the input and output checks
    # execute_code's sandbox: "local" (the runner in the replica's process), grpc://host:port (a
    # `fairway sandbox` service), or "off".
    sandbox: str = "local"
    # The mini pool: a replica's mini_of (it serves its model as the mini pool of this main
    # model); a gateway's mini_model (the mini model, a path or "bundled": its tokenizer builds
    # the prompts the pool serves; `fairway serve` runs it as a second replica too).
    mini_of: str | None = None
    mini_model: str | None = None


def open_sandbox(options: ServerOptions) -> Sandbox | None:
    """The replica's sandbox, or None when turned off (the tool then says so)."""
    if options.sandbox == "off":
        return None
    if options.sandbox == "local":
        from fairway.sandbox import LocalSandbox

        return LocalSandbox()
    from fairway.sandbox.service import GrpcSandbox

    return GrpcSandbox(options.sandbox)


def model_name(model: str | None) -> str:
    return BUNDLED_MODEL_NAME if model is None or model == BUNDLED else Path(model).stem.lower()


BUNDLED = "bundled"  # --mini-model bundled: the bundled model


def _model_path(model: str | None) -> str | None:
    return None if model == BUNDLED else model


def load_tokenizer(model: str | None) -> Tokenizer:
    """The model's tokenizer alone (no weights, no torch): what a gateway needs to build prompts."""
    from fairway.models.tokenizer import Tokenizer

    model = _model_path(model)
    path = Path(model) if model else bundled_model_path()
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def build_engine(options: ServerOptions, model: str | None = None) -> LLMEngine:
    """The engine for an AsyncEngine, loaded in a passing thread (factory.in_passing_thread) since
    its steps will run in the AsyncEngine's own thread. model: another than the options' (the
    mini pool's)."""
    from fairway.engine.factory import build_engine as build
    from fairway.engine.factory import in_passing_thread

    path = _model_path(model) if model is not None else options.model
    config = engine_config(options)
    return in_passing_thread(lambda: build(path, options.dtype, options.device, config, options.weights))


def engine_config(options: ServerOptions) -> EngineConfig:
    from fairway.engine import EngineConfig

    config = EngineConfig(max_model_len=options.max_model_len, background_max_wait_s=options.background_max_wait_s)
    if options.num_kv_blocks:
        config.num_kv_blocks = options.num_kv_blocks
    return config


class Background:
    """Coroutines that run for the app's lifetime, cancelled at shutdown."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []

    def start(self, make: Callable[[], Awaitable[Any]], name: str) -> Callable[[], Awaitable[None]]:
        async def hook() -> None:
            self._tasks.append(asyncio.create_task(make(), name=name))  # type: ignore[arg-type]

        return hook

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every task, again and again until it ends: a cancellation can be lost inside a
        library call (the reply recorder once stayed "cancelling" in its Redis BLMPOP and kept
        polling, so a gateway never exited), and the process must still shut down. One that
        outlives timeout_s is left behind with a warning."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = {task for task in self._tasks if not task.done()}
        while pending and loop.time() < deadline:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=min(0.5, max(deadline - loop.time(), 0.01)))
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: an error at shutdown is not worth a traceback
        for task in pending:
            log.warning("background task %s did not stop within %.0f s", task.get_name(), timeout_s)
        self._tasks.clear()


def _redis_options(options: ServerOptions) -> dict[str, Any]:
    return {"prefix": options.namespace} if options.redis else {}


def open_backends(options: ServerOptions) -> tuple[Relay, ConversationStore, ReplicaRegistry]:
    from fairway.conversation import make_store

    relay = make_relay(options.redis, ttl_s=options.log_ttl_s, **_redis_options(options))
    registry = make_registry(options.redis, **_redis_options(options))
    return relay, make_store(options.database), registry


def open_memory(options: ServerOptions, relay: Relay, router: Router, store: ConversationStore,
                tokenizers: dict[str, Any], index: SqlVectorIndex) -> tuple[MemoryService | None, str | None]:
    """The memory service (vectors and facts in the conversation store's database, extraction by
    the served model on the background lane), or None and the reason it is off."""
    from fairway.memory import BackgroundCompleter, MemoryService, MemorySettings, MemoryStore, readable
    from fairway.retrieval import embedder_available, shared_embedder

    if not options.memory:
        return None, "turned off (ServerOptions.memory)"
    reason = embedder_available()
    if reason is not None:
        log.warning("memory is off: %s", reason)
        return None, reason
    model, tokenizer = next(iter(tokenizers.items()))

    async def messages_of(conversation_id: str) -> list[tuple[str, str]]:
        return readable(await store.list_messages(conversation_id))

    return MemoryService(MemoryStore(index.engine), index, shared_embedder,
                         MemorySettings(idle_s=options.memory_idle_s, poll_s=options.memory_poll_s),
                         BackgroundCompleter(relay, router, tokenizer, model, options.memory_extract_tokens),
                         messages_of), None


def open_files(options: ServerOptions, index: SqlVectorIndex) -> FileService | None:
    """Uploads with retrieval, or None when the embedding model is missing (memory says why)."""
    from fairway.files.objects import make_object_store
    from fairway.files.service import FileService, FileSettings
    from fairway.files.store import FileStore
    from fairway.retrieval import embedder_available, shared_embedder

    if embedder_available() is not None:
        return None
    return FileService(FileStore(index.engine), make_object_store(options.files), index, shared_embedder,
                       options.file_settings or FileSettings())


def gateway_context(
    options: ServerOptions,
    relay: Relay,
    store: ConversationStore,
    registry: ReplicaRegistry,
    tokenizers: dict[str, Any],
    moderator: Moderator | None = None,
) -> GatewayContext:
    from fairway.conversation import database_url
    from fairway.conversation.recorder import ReplyRecorder
    from fairway.conversation.service import ConversationService, ServiceSettings
    from fairway.files.source import FileSource
    from fairway.gateway import GatewayContext
    from fairway.gateway.keys import KeyChecker, ensure_key
    from fairway.gateway.streaming import KEEPALIVE_S, ReplyRelay
    from fairway.limits import LimitsConfig, make_limits
    from fairway.memory import MemorySource
    from fairway.retrieval import SqlVectorIndex
    from fairway.router import Failover, Router
    from fairway.usage.accounting import Accounting

    router = Router(registry, options.router)
    settings = ServiceSettings(default_max_tokens=options.default_max_tokens, max_tool_rounds=options.max_tool_rounds)
    background = Background()
    index = SqlVectorIndex(database_url(options.database))  # memory's and files' (one pool), opened on first use
    memory, memory_off = open_memory(options, relay, router, store, tokenizers, index)
    files = open_files(options, index)
    sources: list[Any] = [MemorySource(memory)] if memory else []
    if files is not None:
        sources.append(FileSource(files))
    moderator = moderator or make_moderator(options.safety)
    service = ConversationService(store, relay, router, tokenizers, settings, sources,
                                  moderator=moderator if options.safety.check_input else None)
    config = dataclasses.replace(options.limits or LimitsConfig(), prefix=options.namespace)
    limits = make_limits(options.redis, config)
    keys = KeyChecker(store, options.auth_cache_s)
    context = GatewayContext(service, ReplyRelay(relay.log, store, service, KEEPALIVE_S if options.keepalive_s is None else options.keepalive_s), relay.log, store, router, limits, keys,
                             memory=memory, memory_off_reason=memory_off, files=files, moderator=moderator)
    if memory is not None:
        context.on_startup += [memory.init, background.start(memory.run, "memory-extraction")]
        context.on_shutdown.append(memory.close)
    if files is not None:
        context.on_startup.append(files.init)
        context.on_shutdown.append(files.close)
    recorder = ReplyRecorder(store, relay.inbox, launched=service.launched)
    context.accounting = Accounting(store, limits, options.pricing, service.launched)
    recorder.on_finished.append(context.accounting.on_finished)

    async def store_keys() -> None:
        for key, user, tier in options.api_keys:
            await ensure_key(store, key, user, tier, name="startup")

    # Every gateway watches for replicas that died or drain, and hands their replies on.
    failover = Failover(registry, relay, router)
    context.on_startup += [store.init, limits.ping, store_keys, background.start(recorder.run, "reply-recorder"),
                           background.start(failover.run, "failover"),
                           background.start(service.watch_lost, "lost-replies")]
    context.on_shutdown += [store.close, relay.close, registry.close, limits.close, background.stop]
    return context


def embedded_app(options: ServerOptions, engine: LLMEngine | None = None,
                 mini_engine: LLMEngine | None = None) -> FastAPI:
    """One process: gateway, recorder and a replica on the engine (built here unless given); with
    options.mini_model a second replica on the mini model (mini_engine, else built), the mini
    pool of the first."""
    from fairway.engine import AsyncEngine
    from fairway.gateway import create_app
    from fairway.replica.worker import ReplicaWorker

    # The policy first: a malformed one is reported at once, not after the model's load.
    moderator = make_moderator(options.safety)  # one for the gateway's checks and the replica's
    engine = engine or build_engine(options)
    name = model_name(options.model)
    relay, store, registry = open_backends(options)
    sandbox = open_sandbox(options)
    engines = [(name, engine, replica_settings(options, name))]
    if options.mini_model:
        mini = model_name(options.mini_model)
        settings = replica_settings(dataclasses.replace(options, replica_id=None, mini_of=name), mini)
        engines.append((mini, mini_engine or build_engine(options, options.mini_model), settings))
    workers = [(ReplicaWorker(AsyncEngine(e), relay, registry, settings,
                              moderator if options.safety.check_output else None, sandbox))
               for _, e, settings in engines]
    context = gateway_context(options, relay, store, registry, {n: e.tokenizer for n, e, _ in engines}, moderator)
    context.on_startup += [worker.start for worker in workers]

    async def stop_engine() -> None:
        for worker in workers:
            await worker.stop()
            await asyncio.to_thread(worker.engine.shutdown)
        if sandbox is not None:
            await sandbox.close()

    context.on_shutdown.append(stop_engine)  # runs first: shutdown hooks run in reverse
    return create_app(context)


def replica_settings(options: ServerOptions, model: str) -> ReplicaSettings:
    from fairway.replica.worker import ReplicaSettings

    settings = ReplicaSettings(model=model, idle_cancel_s=options.idle_cancel_s, drain_grace_s=options.drain_grace_s,
                               max_inflight=options.max_inflight, background_max_wait_s=options.background_max_wait_s,
                               health_host=options.health_host,
                               health_port=options.health_port,
                               output_mode=options.safety.output_mode,
                               max_sentence_chars=options.safety.max_sentence_chars)
    if options.replica_id:
        settings.replica_id = options.replica_id
    if options.region:
        settings.region = options.region
    if options.mini_of:
        settings.mini_of = options.mini_of
    return settings


def gateway_app(options: ServerOptions) -> FastAPI:
    """A stateless gateway process: Redis and a database shared with the other processes."""
    from fairway.gateway import create_app

    relay, store, registry = open_backends(options)
    tokenizers = {model_name(options.model): load_tokenizer(options.model)}
    if options.mini_model:
        tokenizers[model_name(options.mini_model)] = load_tokenizer(options.mini_model)
    return create_app(gateway_context(options, relay, store, registry, tokenizers))


async def run_replica(options: ServerOptions, engine: LLMEngine | None = None, settle: bool = False,
                      drain: asyncio.Event | None = None) -> None:
    """A replica process: the engine, claiming jobs from its queue until cancelled, or until drain
    is set (SIGTERM): then it drains (ReplicaWorker.drain) and returns. settle: this is the
    process's whole job, so once the engine is loaded the heap is settled (fairway/server_gc.py)."""
    from fairway.engine import AsyncEngine
    from fairway.replica.worker import ReplicaWorker

    moderator = make_moderator(options.safety) if options.safety.check_output else None  # (before the load)
    engine = engine or build_engine(options)
    relay = make_relay(options.redis, ttl_s=options.log_ttl_s, **_redis_options(options))
    registry = make_registry(options.redis, **_redis_options(options))
    settings = replica_settings(options, model_name(options.model))
    async_engine = AsyncEngine(engine)
    sandbox = open_sandbox(options)
    worker = ReplicaWorker(async_engine, relay, registry, settings, moderator, sandbox)
    log.info("replica %s serving %s", settings.replica_id, settings.model)
    if settle:
        settle_heap()
    try:
        running = asyncio.create_task(worker.run())
        draining = asyncio.create_task(drain.wait()) if drain is not None else None
        try:
            await asyncio.wait([t for t in (running, draining) if t is not None], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if draining is not None:
                draining.cancel()
        if draining is not None and draining.done() and not draining.cancelled():
            await worker.drain()
        await running
    finally:
        await asyncio.to_thread(async_engine.shutdown)
        if sandbox is not None:
            await sandbox.close()
        await relay.close()
        await registry.close()
