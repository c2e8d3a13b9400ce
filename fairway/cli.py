"""`fairway serve | gateway | replica | up | fleet | sandbox | keys | generate | chat`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import math
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fairway.domain import Tier
from fairway.models.bundled import ModelFileError
from fairway.models.config import ALLOW_LONG_MAX_MODEL_LEN
from fairway.models.weights import WEIGHTS
from fairway.server_gc import settle_heap

if TYPE_CHECKING:  # (imported where used: the conversation package loads SQLAlchemy)
    from fairway.conversation.context_builder import ContextBuilder

# Option types: each refuses, at the command line, a value that would start a server that then
# breaks (a 0 s keepalive floods every stream, port 70000 silently wraps to 4464, NaN passes every
# `< 0` check). argparse prints their message as `argument --flag: ...` and exits 2.

def _number(value: str, convert: type[int] | type[float] = float) -> float:
    """value as a finite number (int or float)."""
    try:
        number = convert(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a {'whole number' if convert is int else 'number'}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {value!r}")
    return number


def _count(value: str) -> int:
    """A positive whole number: something the process needs at least one of (runs at once, tool
    rounds, tokens): 0 would hang every run or silently mean the default."""
    number = int(_number(value, int))
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative_count(value: str) -> int:
    number = int(_number(value, int))
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _positive_seconds(value: str) -> float:
    """A positive float (a period, an interval: 0 would spin or expire everything at once)."""
    seconds = _number(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {value!r}")
    return seconds


def _non_negative(value: str) -> float:
    """A float where 0 has a meaning (no grace, do not wait, free) and below 0 has none."""
    number = _number(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value!r}")
    return number


def _port(value: str) -> int:
    number = int(_number(value, int))
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, not {number}")
    return number


def _port_or_free(value: str) -> int:
    """A port, or 0: a free one."""
    number = int(_number(value, int))
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535 (or 0: a free one), not {number}")
    return number


def _sandbox_url(value: str) -> str:
    """--sandbox: local, off, or grpc://host:port. Anything else was taken as a gRPC host (a typo of
    `local` left the tool 'unreachable' on every run)."""
    if value in ("local", "off"):
        return value
    host, sep, port = value.removeprefix("grpc://").rstrip("/").rpartition(":")
    if not value.startswith("grpc://") or not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"takes local, off or grpc://host:port (a `fairway sandbox`), not {value!r}")
    return value


def _folder(value: str) -> Path:
    """A folder to write in (--log-dir's logs, --files' uploads), made (with its parents) here if
    missing: a path naming a file, or one that cannot be made or written, was a traceback once the
    server was up (the fleet's first replica, the first upload)."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {value!r}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in the folder {value!r}")
    return path


def _model_file(value: str) -> str:
    """--model: a .gguf file or a Hugging Face folder (with its config.json). A missing one was a
    traceback in the gateway, and in serve and replica a late exit 1 after the servers' checks."""
    path = Path(value)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{value!r} does not exist: pass a .gguf file or a Hugging Face folder")
    if path.is_dir() and not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{value!r} is a folder without config.json: pass a .gguf file or a "
                                         "Hugging Face folder")
    return value


def _mini_model(value: str) -> str:
    """--mini-model: a model (_model_file), or 'bundled'."""
    return value if value == "bundled" else _model_file(value)


def _files(value: str) -> str:
    """--files: an s3://bucket as given, else a folder (_folder)."""
    return value if value.startswith("s3://") else str(_folder(value))


MIN_MODEL_LEN = 128  # a chat template and a short message with room for a reply
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
LOG_LEVEL_HELP = "the least severe log lines printed (default info)"


def _model_len(value: str) -> int:
    number = int(_number(value, int))
    if number < MIN_MODEL_LEN:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_MODEL_LEN} tokens (a prompt and a reply), "
                                         f"got {number}")
    return number


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_model_file, default=None, help="a .gguf file or Hugging Face folder (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="activations and KV cache (and the weights, where they are not run as stored)")
    p.add_argument("--weights", default="auto", choices=list(WEIGHTS),
                   help="a GGUF's Q8_0/Q4_0/Q4_1 layers: multiplied as stored where this CPU has the kernels "
                        "(native), the same with a bf16 copy for steps of many rows where this CPU multiplies "
                        "that faster (auto: from 12 rows, AVX512-BF16 without AMX), or dequantized to --dtype at load")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda[:N]: the GPU path (Triton paged attention, CUDA graphs; needs a CUDA build "
                        "of torch and triton)")
    _max_model_len_arg(p)  # every command that builds an engine: one option, one check (_check_window)


def _build(args: argparse.Namespace):
    from fairway.engine import EngineConfig
    from fairway.engine.factory import build_engine

    config = EngineConfig(max_model_len=getattr(args, "max_model_len", None))
    return build_engine(args.model, args.dtype, args.device, config, weights=args.weights)


def cmd_generate(args: argparse.Namespace) -> int:
    from fairway.engine import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine = _build(args)
    tok = engine.tokenizer
    if args.chat:
        prompt = tok.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


CHAT_MAX_TOKENS = 256  # an answer's tokens at most, unless --max-tokens says otherwise


@dataclass
class _ChatHistory:
    """The session's messages, sent to the engine within its window: the context builder's rule,
    as the API applies it (system text always, then the newest whole turns, room for the reply)."""

    builder: ContextBuilder
    max_tokens: int
    system: list[dict[str, str]]
    turns: list[dict[str, str]] = field(default_factory=list)
    told: bool = False  # the user heard that older turns are left out

    def prompt(self, line: str) -> list[int]:
        """The prompt for the new line (ContextTooLong when the line alone leaves no room).
        Turns dropped now stay dropped: the chat forgets them once, rather than on and off."""
        context = self.builder.build(self.system, self.turns, [{"role": "user", "content": line}], self.max_tokens)
        del self.turns[: context.dropped_messages]
        if context.dropped_turns and not self.told:
            self.told = True
            print(f"fairway chat: the oldest turns no longer fit the {self.builder.window}-token window; "
                  "they are left out from here on", file=sys.stderr, flush=True)
        return context.prompt_token_ids

    def answered(self, line: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def cmd_chat(args: argparse.Namespace) -> int:
    from fairway.conversation.context_builder import ContextBuilder, reply_max_tokens
    from fairway.engine import SamplingParams

    engine = _build(args)
    max_tokens = args.max_tokens or reply_max_tokens(CHAT_MAX_TOKENS, engine.max_model_len)  # the API's rule
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = _ChatHistory(ContextBuilder(engine.tokenizer, engine.max_model_len), max_tokens, system)
    print("Fairway chat with the bundled model. Empty line or Ctrl-D quits; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()  # (the shell's prompt on a line of its own)
            break
        except KeyboardInterrupt:
            print()
            return 130
        if not line.strip():
            break
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=args.seed)
        try:
            reply = _stream_reply(engine, history.prompt(line), params)
        except ValueError as exc:  # too long for the window, say: this message is not sent, the chat goes on
            print(f"fairway chat: {str(exc).rstrip('.')}; not sent", file=sys.stderr, flush=True)
            continue
        history.answered(line, reply)
    return 0


def _stream_reply(engine, prompt: list[int], params) -> str:
    """Generate one reply, writing it as it comes; the text written. Ctrl-C stops the reply
    (what was written is kept), between two steps: a KeyboardInterrupt raised inside a step
    could leave the engine half-way through it, and the chat needs it again."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)  # (ValueError: the prompt can never run)
    reply: list[str] = []
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    try:
        while engine.has_unfinished():
            if interrupted and request_id in engine.requests:
                engine.abort(request_id)
            for out in engine.step():
                if not interrupted:
                    reply.append(out.text)
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    if interrupted:
        print("[stopped]", file=sys.stderr, flush=True)
    return "".join(reply)


def _pairs(values: list[str] | None, flag: str) -> dict[str, int]:
    out = {}
    for value in values or []:
        name, sep, number = value.partition("=")
        if not sep or not number.strip().isdigit() or int(number) < 1:  # 0 would refuse the tier's every request
            raise ValueError(f"{flag} takes TIER=NUMBER (at least 1), got {value!r}")
        out[name.strip()] = int(number)
    return out


def _limits_config(args: argparse.Namespace):
    from fairway.limits import LimitsConfig, TierLimits
    from fairway.limits.config import default_tiers

    tiers = default_tiers()
    tpm, rpm = _pairs(getattr(args, "tpm", None), "--tpm"), _pairs(getattr(args, "rpm", None), "--rpm")
    for name in set(tpm) | set(rpm):
        if name not in tiers:
            raise ValueError(f"unknown tier {name!r} in --tpm/--rpm: use one of {', '.join(tiers)}")
        base = tiers[name]
        tiers[name] = TierLimits(tpm.get(name, base.tokens_per_minute), rpm.get(name, base.requests_per_minute))
    config = LimitsConfig(tiers=tiers)
    for name in ("ip_requests_per_minute", "max_in_flight", "max_waiting", "admission_timeout_s"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(config, name, value)
    return config


def _pricing(args: argparse.Namespace):
    from fairway.usage.pricing import Price, Pricing

    base = Pricing().default
    prompt = getattr(args, "prompt_price_per_1k", None)
    completion = getattr(args, "completion_price_per_1k", None)
    cached = getattr(args, "cached_price_per_1k", None)
    return Pricing(Price(base.prompt_per_1k if prompt is None else prompt,
                         base.completion_per_1k if completion is None else completion,
                         base.cached_prompt_per_1k if cached is None else cached),
                   models=_model_prices(getattr(args, "model_price", None)))


def _model_prices(values: list[str] | None):
    """--model-price MODEL=PROMPT,COMPLETION[,CACHED]: a model's own price per 1k tokens (the
    mini pool's, billed at its own price past a limit)."""
    from fairway.usage.pricing import Price

    prices = {}
    for value in values or []:
        name, sep, numbers = value.partition("=")
        try:
            parts = [float(n) for n in numbers.split(",")]
        except ValueError:
            parts = []
        if not sep or not name.strip() or len(parts) not in (2, 3) or min(parts) < 0:
            raise ValueError(f"--model-price takes MODEL=PROMPT,COMPLETION[,CACHED] (prices per 1k tokens, "
                             f"none negative), got {value!r}")
        prices[name.strip()] = Price(*parts)
    return prices


def _server_options(args: argparse.Namespace):
    from fairway.assembly import ServerOptions

    return ServerOptions(
        model=getattr(args, "model", None),
        dtype=getattr(args, "dtype", "bfloat16"),
        weights=getattr(args, "weights", "auto"),
        device=getattr(args, "device", "cpu"),
        redis=getattr(args, "redis", None),
        database=getattr(args, "database", None),
        namespace=args.namespace,
        log_ttl_s=args.log_ttl,
        idle_cancel_s=getattr(args, "idle_cancel", 30.0),
        max_model_len=getattr(args, "max_model_len", None),
        replica_id=getattr(args, "replica_id", None),
        drain_grace_s=getattr(args, "drain_grace", 30.0),
        background_max_wait_s=getattr(args, "background_max_wait", 30.0),
        max_inflight=getattr(args, "max_inflight", 256),
        health_host=getattr(args, "health_host", "127.0.0.1"),
        health_port=getattr(args, "health_port", None),
        region=getattr(args, "region", None),
        router=_router_settings(args),
        default_max_tokens=getattr(args, "default_max_tokens", 512),
        max_tool_rounds=getattr(args, "max_tool_rounds", 5),
        limits=_limits_config(args),
        pricing=_pricing(args),
        keepalive_s=getattr(args, "keepalive", 10.0),
        memory=not getattr(args, "no_memory", False),
        memory_idle_s=getattr(args, "memory_idle", 300.0),
        files=getattr(args, "files", None),
        safety=_safety_settings(args),
        sandbox=getattr(args, "sandbox", "local"),
        mini_of=getattr(args, "mini_of", None),
        mini_model=getattr(args, "mini_model", None),
    )


def _router_settings(args: argparse.Namespace):
    from fairway.router import RouterSettings
    from fairway.router.pressure import PressureSettings

    default = RouterSettings()
    pressure = default.pressure
    return RouterSettings(routing=getattr(args, "routing", default.routing),
                          overflow_abs=getattr(args, "overflow_abs", default.overflow_abs),
                          overflow_rel=getattr(args, "overflow_rel", default.overflow_rel),
                          pressure=PressureSettings(
                              max_wait_s=getattr(args, "max_wait", pressure.max_wait_s),
                              free_at_capacity=getattr(args, "free_at_capacity", pressure.free_at_capacity),
                              shorter_max_tokens=getattr(args, "shorter_max_tokens", pressure.shorter_max_tokens),
                              mini_past_quota=not getattr(args, "no_mini_past_quota", False)))


def _safety_settings(args: argparse.Namespace):
    from fairway.safety import SafetySettings

    mode = getattr(args, "safety_output", "check-then-release")
    return SafetySettings(check_input=not getattr(args, "no_input_check", False), check_output=mode != "off",
                          output_mode="check-then-release" if mode == "off" else mode,
                          max_sentence_chars=getattr(args, "max_sentence_chars", 300),
                          policy_path=getattr(args, "safety_policy", None),
                          profanity_model=not getattr(args, "no_profanity_model", False))


def _listen(args: argparse.Namespace, host: str | None = None, port: int | None = None) -> socket.socket | None:
    """The API's listening socket (or host:port's), bound before the model loads: a port another
    program holds, or an unknown host, was found only once the server had started (uvicorn's
    several lines, exit 3). None, said in one line, where it cannot listen. --reuse-port: several
    gateway processes listen on one port and the kernel spreads the connections over them (`fairway up`)."""
    host, port = host or args.host, args.port if port is None else port
    try:
        return _listening_socket(host, port, reuse_port=getattr(args, "reuse_port", False))
    except OSError as exc:
        print(f"fairway {args.command}: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None


def _serve_app(app, args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from fairway.gateway.http_protocol import server_config

    server = uvicorn.Server(server_config(app, args.host, args.port, args.log_level, timeout_graceful_shutdown=5))
    settle_heap()  # a server process from here on (fairway/server_gc.py)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl+C: uvicorn re-raises it once shut down
        server.run(sockets=[sock])
    return 0 if server.started else 3  # 3: did not start, as uvicorn.run() exits


def _listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own bind)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


DEV_USER = "dev"
DEV_KEY_FILE = Path(".fairway") / "dev-key"


def _dev_key() -> str:
    """FAIRWAY_DEV_KEY, else the key kept in ./.fairway/dev-key (made on first use), so the chat
    page's stored key keeps working across restarts."""
    from fairway.gateway.keys import check_format, generate_key

    key = os.environ.get("FAIRWAY_DEV_KEY", "").strip()
    if key:
        check_format(key)
        return key
    if DEV_KEY_FILE.is_file():
        key = DEV_KEY_FILE.read_text().strip()
        with contextlib.suppress(ValueError):
            check_format(key)
            return key
    key = generate_key()
    DEV_KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
    DEV_KEY_FILE.touch(mode=0o600)
    DEV_KEY_FILE.write_text(key + "\n")
    return key


def cmd_serve(args: argparse.Namespace) -> int:
    from fairway.assembly import embedded_app

    options = _server_options(args)
    if not _servers_answer("serve", database=options.database) or (sock := _listen(args)) is None:
        return 2
    key = _dev_key()
    options.api_keys.append((key, DEV_USER, "paid"))
    print(f"Fairway: loading {options.model or 'the bundled model'} ...", file=sys.stderr)
    app = embedded_app(options)
    url = f"http://{args.host}:{args.port}"
    print(f"Fairway: chat page on {url}/ , OpenAI-compatible API on {url}/v1", file=sys.stderr)
    print(f"Fairway: development key (user {DEV_USER!r}, tier paid; more with `fairway keys create`):", file=sys.stderr)
    print(key, file=sys.stderr, flush=True)
    return _serve_app(app, args, sock)


def cmd_gateway(args: argparse.Namespace) -> int:
    from fairway.assembly import gateway_app

    options = _server_options(args)  # (its own errors first: one line each)
    if not _servers_answer("gateway", redis=options.redis, database=options.database) or (sock := _listen(args)) is None:
        return 2
    return _serve_app(gateway_app(options), args, sock)


def cmd_replica(args: argparse.Namespace) -> int:
    from fairway.assembly import run_replica

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how a replica that hangs says where.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import fairway.usage.metrics  # noqa: F401  (registers the metrics the health port's /metrics serves)

    options = _server_options(args)
    if not _servers_answer("replica", redis=options.redis):
        return 2
    # The health server binds once the model is loaded (replica/health.py), where a taken port was a
    # traceback: tried here first, in one line (a port taken during the load still fails there).
    if (health := _listen(args, args.health_host, args.health_port)) is None:
        return 2
    health.close()

    async def main() -> None:
        # SIGTERM (the supervisor, Kubernetes) or Ctrl-C drains: the replica leaves routing at
        # once, finishes what it can within --drain-grace and hands the rest on to other replicas
        # (ReplicaWorker.drain). A second signal stops it now: replies in flight get a final event.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        drain = asyncio.Event()

        def on_signal() -> None:
            if drain.is_set():
                task.cancel()
            drain.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        with contextlib.suppress(asyncio.CancelledError):
            await run_replica(options, settle=True, drain=drain)

    asyncio.run(main())
    return 0


def cmd_sandbox(args: argparse.Namespace) -> int:
    from fairway.sandbox import LocalSandbox, RunnerSettings
    from fairway.sandbox.service import start_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        sandbox = LocalSandbox(RunnerSettings(python=args.python, max_concurrent=args.max_concurrent,
                                              per_tenant=args.per_tenant))
        try:  # before the check (a run): a bad or taken address is one line at once
            server, port = await start_server(sandbox, args.listen)
        except OSError as exc:
            raise SandboxListenError(f"fairway sandbox: cannot listen on {args.listen}: "
                                     f"{exc.strerror or exc}") from None
        reason = await sandbox.check()
        # The first line says where it listens (a supervisor, or a test, reads it).
        print(f"sandbox listening on {args.listen.rpartition(':')[0]}:{port}"
              + (f" (code execution is off: {reason})" if reason else ""), flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=2.0)
        await sandbox.close()  # (its runs' memory cgroups)

    try:
        asyncio.run(main())
    except SandboxListenError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


class SandboxListenError(Exception):
    """The sandbox service cannot listen where it was told (the message says why)."""


def _database_url(args: argparse.Namespace) -> str | None:
    return args.database or os.environ.get("FAIRWAY_DATABASE_URL")


DATABASE_SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg", "sqlite", "sqlite+aiosqlite")


def _servers_answer(command: str, redis: str | None = None, database: str | None = None) -> bool:
    """Whether the Redis and the PostgreSQL named answer and let us in (None: not used), else one
    line naming the first that does not, as `fairway up` says it: checked before the model loads,
    where a missing server (or a refused login) was a long traceback. A missing PostgreSQL database
    is created, as `up` does. A database URL no store takes, or a SQLite path that is not a
    database, is a ValueError (one line from main)."""
    from fairway.up import ServerUnusable, check_servers

    scheme = (database or "").partition("://")[0]
    if database and ("://" not in database or scheme not in DATABASE_SCHEMES):
        raise ValueError(f"--database takes postgresql://user@host/db or sqlite:///path, not {database!r}")
    if database and scheme.startswith("sqlite"):
        _check_sqlite(database)
    try:
        asyncio.run(check_servers(redis, database if scheme.startswith("postgres") else None))
    except ServerUnusable as exc:
        print(f"fairway {command}: {exc}", file=sys.stderr)
        return False
    return True


def _check_sqlite(url: str) -> None:
    """ValueError where url's file exists but is no SQLite database (a text file, a folder): the
    store's first query was a traceback, after the model loaded. A missing file is made later."""
    import sqlite3

    from sqlalchemy.engine import make_url

    from fairway.conversation import database_url

    path = make_url(database_url(url)).database
    if not path or path == ":memory:" or not Path(path).exists():
        return
    if Path(path).is_dir():
        raise ValueError(f"--database {url}: {path} is a folder, not a SQLite database")
    try:  # read-only: a check never writes (nor makes a journal beside) a file it then refuses
        with contextlib.closing(sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)) as conn:
            conn.execute("PRAGMA schema_version")
    except sqlite3.Error as exc:
        raise ValueError(f"--database {url}: {path} is not a SQLite database ({exc})") from None


def cmd_up(args: argparse.Namespace) -> int:
    from fairway.up import UpOptions, shown_url, up

    if not args.database.partition("://")[0].startswith("postgres"):  # (FAIRWAY_DATABASE_URL may be serve's SQLite)
        raise ValueError(f"--database takes postgresql://user@host/db (up's gateways share one PostgreSQL), "
                         f"not {shown_url(args.database)!r}")
    return up(UpOptions(args.replicas, args.gateways, args.redis, args.database, args.host, args.port,
                        args.namespace, args.replica_arg, args.gateway_arg))


def cmd_fleet(args: argparse.Namespace) -> int:
    from fairway.fleet import (
        FleetConfigError,
        FleetManager,
        HoltForecaster,
        ScalingBounds,
        ScalingPolicy,
        ScalingTarget,
    )
    from fairway.replica.registry import make_registry

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (the local backend's /ready probes, twice a second)
    try:  # every bound checked before anything starts
        policy = ScalingPolicy(ScalingBounds(args.min_replicas, args.max_replicas, args.step, args.cooldown, args.idle),
                               ScalingTarget(args.replica_rps, args.ttft_target, args.headroom, args.lead,
                                             args.queue_per_replica))
        forecaster = HoltForecaster(args.alpha, args.beta)
        if args.interval <= 0:
            raise FleetConfigError(f"--interval must be above 0 s, got {args.interval}")
        if args.replica_threads is not None and args.replica_threads < 1:
            raise FleetConfigError(f"--replica-threads must be at least 1, got {args.replica_threads}")
        k8s = _k8s_client(args.kubeconfig) if args.backend == "kubernetes" else None
    except (FleetConfigError, ValueError) as exc:
        print(f"fairway fleet: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)

    async def main() -> None:
        backend = _fleet_backend(args, k8s)
        registry = make_registry(args.redis, prefix=args.namespace)
        manager = FleetManager(backend, registry, policy, forecaster, args.interval)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await manager.run(stop)
        finally:
            await backend.close()
            await registry.close()
            if args.backend == "local":  # its replicas are this process's children: they drain with it
                await asyncio.to_thread(backend.stop)

    asyncio.run(main())
    return 0


def _k8s_client(kubeconfig: str | None):
    """The Kubernetes API client, or FleetConfigError (one line) where there are no credentials: a
    kubeconfig that is missing or broken was a traceback."""
    import yaml
    from kubernetes.config import ConfigException

    from fairway.fleet import FleetConfigError
    from fairway.fleet.k8s import api_client

    try:
        return api_client(kubeconfig)
    except (ConfigException, OSError, yaml.YAMLError) as exc:
        where = kubeconfig or "not in a cluster, and KUBECONFIG or ~/.kube/config"
        said = " ".join(str(exc).split())  # (a YAML error spans lines)
        raise FleetConfigError(f"no Kubernetes credentials ({where}): {said}") from None
    except (TypeError, AttributeError):  # YAML, but not a mapping: the loader indexes into it blindly
        raise FleetConfigError(f"no Kubernetes credentials ({kubeconfig or 'KUBECONFIG or ~/.kube/config'}): "
                               "not a kubeconfig (a YAML mapping of clusters, users and contexts)") from None


def _fleet_backend(args: argparse.Namespace, k8s_client=None):
    if args.backend == "kubernetes":
        from fairway.fleet.k8s import KubernetesBackend

        return KubernetesBackend(args.deployment, args.k8s_namespace, k8s_client)
    from fairway.fleet.local import LocalBackend

    return LocalBackend(args.redis, args.namespace, args.replica_arg, args.log_dir,
                        max_replicas=args.max_replicas, threads=args.replica_threads)


def cmd_keys(args: argparse.Namespace) -> int:
    from fairway.conversation import make_store
    from fairway.gateway import keys

    if not _servers_answer("keys", database=_database_url(args)):
        return 2

    async def run() -> int:
        store = make_store(_database_url(args))
        await store.init()
        try:
            if args.keys_command == "create":
                try:
                    record, key = await keys.create_key(store, args.user, args.tier, args.name or "",
                                                        region=args.region)
                except ValueError as exc:
                    print(f"fairway: {exc}", file=sys.stderr)
                    return 2
                served = f", served in region {record.region}" if record.region else ""
                print(f"Created {record.id} for user {record.user_id!r} (tier {record.tier}{served}). "
                      "The key is shown this once:")
                print(key, flush=True)
            elif args.keys_command == "revoke":
                return await _revoke(store, args.key)
            else:
                _list_keys(await store.list_api_keys(args.user))
            return 0
        finally:
            await store.close()

    return asyncio.run(run())


async def _revoke(store, key_or_id: str) -> int:
    import time

    from fairway.gateway import keys

    before = time.time()  # (the store's clock: a revocation stamped earlier was not this one)
    record = await keys.revoke(store, key_or_id)
    if record is None:
        print(f"fairway: no such key {key_or_id if key_or_id.startswith('key_') else keys.redact(key_or_id)}",
              file=sys.stderr)
        return 1
    if record.revoked_at is not None and record.revoked_at < before:
        print(f"{record.id} (user {record.user_id!r}) was already revoked, at {_time(record.revoked_at)} UTC")
    else:
        print(f"Revoked {record.id} (user {record.user_id!r})")
    return 0


def _list_keys(rows) -> None:
    """One key a line; its name (keys create --name) last, as it may be long."""
    print(f"{'id':<37} {'user':<20} {'tier':<10} {'key':<16} {'created':<20} {'revoked':<20} name")
    for r in rows:
        revoked = _time(r.revoked_at) if r.revoked_at else "-"
        print(f"{r.id:<37} {r.user_id:<20} {r.tier:<10} {r.prefix:<16} {_time(r.created_at):<20} {revoked:<20} "
              f"{r.name}".rstrip())


def _time(ts: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _memory_files_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory and files")
    g.add_argument("--no-memory", action="store_true", help="no facts across conversations")
    g.add_argument("--memory-idle", type=_positive_seconds, default=300.0, metavar="S",
                   help="a conversation idle this long gets its facts extracted (default 300)")
    g.add_argument("--files", type=_files, default=os.environ.get("FAIRWAY_FILES"),
                   help="uploads: a directory (default ./.fairway/files) or s3://bucket (endpoint from "
                        "AWS_ENDPOINT_URL, pre-signed uploads)")


def _limits_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits and pricing")
    g.add_argument("--tpm", action="append", metavar="TIER=N", help="tokens per minute per user per model for a tier "
                   "(repeatable; defaults: free=40000 paid=400000 business=2000000 background=1000000)")
    g.add_argument("--rpm", action="append", metavar="TIER=N", help="requests per minute per user for a tier")
    g.add_argument("--ip-rpm", dest="ip_requests_per_minute", type=_count, default=None,
                   help="requests per minute per client IP (default 1200; at least 1: there is no 'off')")
    g.add_argument("--max-in-flight", type=_count, default=None, help="chat requests this gateway serves at once (256)")
    g.add_argument("--max-waiting", type=_non_negative_count, default=None,
                   help="requests waiting for a slot before 503 (1024; 0: none wait)")
    g.add_argument("--admission-timeout", dest="admission_timeout_s", type=_non_negative, default=None,
                   help="seconds a request waits for a slot before 503 (5; 0: it does not wait)")
    g.add_argument("--prompt-price-per-1k", type=_non_negative, default=None, help="usage cost per 1k prompt tokens "
                   "(default 0.00015; completion 0.0006)")
    g.add_argument("--completion-price-per-1k", type=_non_negative, default=None, help="... per 1k completion tokens")
    g.add_argument("--cached-price-per-1k", type=_non_negative, default=None, help="... per 1k cached prompt tokens "
                   "(default: half the prompt price)")
    g.add_argument("--model-price", action="append", metavar="MODEL=PROMPT,COMPLETION[,CACHED]",
                   help="one model's own prices per 1k tokens, e.g. the mini pool's (repeatable; other models: "
                        "the prices above)")


def _router_args(p: argparse.ArgumentParser) -> None:
    from fairway.router import ROUTINGS, RouterSettings

    default = RouterSettings()
    g = p.add_argument_group("routing (fairway/router/)")
    g.add_argument("--routing", default=default.routing, choices=ROUTINGS,
                   help="affinity: the replica with most of the prompt's prefix cached, unless overloaded; "
                        "round-robin: each replica in turn (for comparison)")
    g.add_argument("--overflow-abs", type=_non_negative_count, default=default.overflow_abs, metavar="N",
                   help="pass over the best-scoring replica when it has more than N replies more than the least "
                        "loaded ...")
    g.add_argument("--overflow-rel", type=_non_negative, default=default.overflow_rel, metavar="X",
                   help="... and more than X times the least loaded one's load more")


def _pressure_args(p: argparse.ArgumentParser) -> None:
    from fairway.router.pressure import AT_CAPACITY, PressureSettings

    default = PressureSettings()
    g = p.add_argument_group("peak load: free requests at capacity, the mini pool (fairway/router/pressure.py)")
    g.add_argument("--max-wait", type=_non_negative, default=default.max_wait_s, metavar="S",
                   help="a free request predicted to wait longer than S seconds to start (the queue ahead of it "
                        "over the replica's measured drain rate) finds its model's pool at capacity")
    g.add_argument("--free-at-capacity", default=default.free_at_capacity, choices=AT_CAPACITY,
                   help="what it gets then: shed (503 + Retry-After, the reply stored SHED), mini (the model's mini "
                        "pool serves it), shorten (at most --shorter-max-tokens)")
    g.add_argument("--shorter-max-tokens", type=_count, default=default.shorter_max_tokens, metavar="N",
                   help=f"the most tokens a free reply gets under shorten (default {default.shorter_max_tokens})")
    g.add_argument("--mini-model", type=_mini_model, default=None, metavar="PATH",
                   help="the mini pool's model (a .gguf file or Hugging Face folder, or 'bundled'): its replicas "
                        "run `fairway replica --model PATH --mini-of MAIN`")
    g.add_argument("--no-mini-past-quota", action="store_true",
                   help="a user whose token quota for the model is spent gets a 429, not the mini pool")


def _safety_args(p: argparse.ArgumentParser, stages: tuple[str, ...]) -> None:
    g = p.add_argument_group("safety (fairway/safety/)")
    g.add_argument("--safety-policy", default=None, metavar="PATH",
                   help="the policy file: per-category thresholds, terms and patterns (default: the bundled policy.toml)")
    g.add_argument("--no-profanity-model", action="store_true",
                   help="classify with the policy's patterns only (without alt-profanity-check, the safety extra)")
    if "input" in stages:
        g.add_argument("--no-input-check", action="store_true", help="do not check the user's new message")
    if "output" in stages:
        g.add_argument("--safety-output", default="check-then-release",
                       choices=["check-then-release", "release-then-check", "off"],
                       help="the reply's check, per sentence: hold each back until checked (default), stream first "
                            "and stop after a flagged one, or none")
        g.add_argument("--max-sentence-chars", type=_count, default=300,
                       help="a sentence without an end is checked (and released) at this length")


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the address the API listens on (default 127.0.0.1; "
                   "0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8000, help="the API's TCP port (default 8000)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
    p.add_argument("--keepalive", type=_positive_seconds, default=10.0,
                   help="seconds without events before a stream gets an SSE keepalive (for proxies' idle timeouts)")


def _relay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default="fairway:", help="Redis key prefix (separate deployments on one Redis)")
    p.add_argument("--log-ttl", type=_positive_seconds, default=1800.0, help="seconds a reply's token log is kept after its last event")


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--idle-cancel", type=_positive_seconds, default=30.0, help="cancel a reply nobody listened to for this many seconds")
    p.add_argument("--sandbox", default="local", type=_sandbox_url,
                   help="execute_code's sandbox: local (in this process), grpc://host:port (`fairway sandbox`), or off")
    p.add_argument("--background-max-wait", type=_positive_seconds, default=30.0, metavar="S",
                   help="background work (memory extraction) waiting this long, to be claimed or in the engine, "
                        "moves up a lane: a free flood never starves it for ever")


def _max_model_len_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=_model_len, default=None,
                   help=f"cap the context window (tokens, at least {MIN_MODEL_LEN}; at most the model's context "
                        f"length, unless {ALLOW_LONG_MAX_MODEL_LEN}=1 in the environment: past its trained positions "
                        "a reply is likely garbage)")


def _fleet_args(sub) -> None:
    from fairway.up import DEFAULT_REDIS

    f = sub.add_parser("fleet", help="the fleet manager: forecasts arrivals, adds replicas ahead of them, drains "
                       "idle ones (local processes or a Kubernetes Deployment)")
    f.add_argument("--backend", default="local", choices=["local", "kubernetes"],
                   help="where replicas run: local (`fairway replica` processes on this machine, default) or "
                        "kubernetes (a Deployment's scale)")
    f.add_argument("--redis", default=os.environ.get("FAIRWAY_REDIS_URL", DEFAULT_REDIS),
                   help="the replica registry's Redis (the replicas' heartbeats)")
    f.add_argument("--namespace", default="fairway:", help="Redis key prefix")
    g = f.add_argument_group("scaling bounds")
    g.add_argument("--min-replicas", type=int, default=1, help="never fewer (at least 1: never scales to zero)")
    g.add_argument("--max-replicas", type=int, default=8, help="never more (default 8)")
    g.add_argument("--step", type=int, default=1, help="replicas added by one decision at most")
    g.add_argument("--cooldown", type=_number, default=30.0, metavar="S", help="seconds between two scaling actions")
    g.add_argument("--idle", type=_number, default=120.0, metavar="S",
                   help="seconds the forecast must fit in one replica fewer before one drains")
    g = f.add_argument_group("what a replica serves")
    g.add_argument("--replica-rps", type=_number, default=1.0, metavar="R",
                   help="replies per second one replica serves within the TTFT target (measure it: bench/)")
    g.add_argument("--ttft-target", type=_number, default=2.0, metavar="S", help="the TTFT p99 to keep")
    g.add_argument("--headroom", type=_number, default=0.8, help="plan each replica at this share of --replica-rps")
    g.add_argument("--lead", type=_number, default=60.0, metavar="S",
                   help="forecast at least this far ahead; further when the replicas took longer to start "
                        "(measured: asked for to ready)")
    g.add_argument("--queue-per-replica", type=_number, default=8.0, metavar="N",
                   help="waiting replies per replica that add one whatever the forecast")
    g.add_argument("--alpha", type=_number, default=0.3, help="the forecast's level smoothing (Holt), in (0, 1]")
    g.add_argument("--beta", type=_number, default=0.1, help="the forecast's trend smoothing (Holt), in (0, 1]")
    g.add_argument("--interval", type=_number, default=1.0, metavar="S", help="seconds between two looks")
    g = f.add_argument_group("local backend")
    g.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                   help="passed on to every replica (repeat it: --replica-arg=--dtype --replica-arg=float32)")
    g.add_argument("--log-dir", type=_folder, default=None,
                   help="each replica's output to ID.log here, made if missing (default: this one's)")
    g.add_argument("--replica-threads", type=int, default=None, metavar="N",
                   help="CPU threads per replica (default: this machine's CPUs over --max-replicas, so the "
                        "replicas never oversubscribe them)")
    g = f.add_argument_group("kubernetes backend")
    g.add_argument("--deployment", default="fairway-replica", help="the replica Deployment to scale")
    g.add_argument("--k8s-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                   help="the Deployment's namespace (default: $POD_NAMESPACE, else 'default')")
    g.add_argument("--kubeconfig", default=None, help="default: in-cluster credentials, else KUBECONFIG")
    f.add_argument("--metrics-port", type=_port, default=None, help="serve the fleet's Prometheus /metrics here")
    f.add_argument("--metrics-host", default="127.0.0.1", help="where /metrics listens (default 127.0.0.1)")
    f.add_argument("--log-level", default="info", choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
    f.set_defaults(func=cmd_fleet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairway", description="Fairway LLM serving stack")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt; prints only the generated text")
    g.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    g.add_argument("--max-tokens", type=_count, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=_non_negative, default=0.0,
                   help="sampling temperature (default 0: greedy, the same text every run)")
    g.add_argument("--seed", type=int, default=None, help="the sampler's seed, for a repeatable sampled text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a terminal chat with the model; the conversation is kept across turns")
    c.add_argument("--max-tokens", type=_count, default=None,
                   help=f"tokens per answer at most (default {CHAT_MAX_TOKENS}, or half the window when less)")
    c.add_argument("--temperature", type=_non_negative, default=0.7, help="sampling temperature (default 0.7; 0: greedy)")
    c.add_argument("--seed", type=int, default=None, help="the sampler's seed, for repeatable answers")
    c.add_argument("--system", default=None, help="a system message for the conversation")
    _engine_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="the OpenAI-compatible API with the model, all in one process (no other servers)")
    _http_args(s)
    _engine_args(s)
    _relay_args(s)
    _generation_args(s)
    s.add_argument("--database", default=os.environ.get("FAIRWAY_DATABASE_URL"),
                   help="conversation store URL (default: SQLite in ./.fairway/)")
    s.add_argument("--default-max-tokens", type=_count, default=512,
                   help="a reply's max_tokens when the request gives none (default 512)")
    s.add_argument("--max-tool-rounds", type=_count, default=5, help="tool runs per reply (execute_code); then it ends")
    _limits_args(s)
    _pressure_args(s)
    _memory_files_args(s)
    _safety_args(s, ("input", "output"))
    s.set_defaults(func=cmd_serve)

    gw = sub.add_parser("gateway", help="a stateless API gateway sharing Redis and a database with replicas")
    _http_args(gw)
    _relay_args(gw)
    gw.add_argument("--redis", required=not os.environ.get("FAIRWAY_REDIS_URL"),
                    default=os.environ.get("FAIRWAY_REDIS_URL"), help="redis://host:port/db")
    gw.add_argument("--database", required=not os.environ.get("FAIRWAY_DATABASE_URL"),
                    default=os.environ.get("FAIRWAY_DATABASE_URL"), help="postgresql://user@host/db (or sqlite://)")
    gw.add_argument("--model", type=_model_file, default=None, help="the model whose tokenizer builds prompts (default: bundled)")
    gw.add_argument("--reuse-port", action="store_true", help="share the port with other gateway processes (SO_REUSEPORT)")
    gw.add_argument("--default-max-tokens", type=_count, default=512,
                    help="a reply's max_tokens when the request gives none (default 512)")
    gw.add_argument("--max-tool-rounds", type=_count, default=5, help="tool runs per reply (execute_code); then it ends")
    _router_args(gw)
    _pressure_args(gw)
    _limits_args(gw)
    _memory_files_args(gw)
    _safety_args(gw, ("input",))
    gw.set_defaults(func=cmd_gateway)

    r = sub.add_parser("replica", help="an engine process: claims replies from Redis, writes their tokens back")
    _engine_args(r)
    _relay_args(r)
    _generation_args(r)
    r.add_argument("--redis", required=not os.environ.get("FAIRWAY_REDIS_URL"),
                   default=os.environ.get("FAIRWAY_REDIS_URL"), help="redis://host:port/db")
    r.add_argument("--replica-id", default=None,
                   help="this replica's name in the registry (default: a new one); restarted under the same id, "
                        "it carries on the replies it had claimed")
    r.add_argument("--max-inflight", type=_count, default=256,
                   help="replies claimed at once; more wait in this replica's queue (a failover moves them too)")
    r.add_argument("--drain-grace", type=_non_negative, default=30.0,
                   help="on SIGTERM, seconds the replies in flight get to finish here before they are handed on")
    r.add_argument("--region", default=None, help="the region it serves, for requests that name one "
                   "(X-Fairway-Region; default: FAIRWAY_REGION, else 'local')")
    r.add_argument("--health-port", type=_port_or_free, default=0,
                   help="GET /health, /ready and /metrics (Prometheus) here (0: a free port; the heartbeat "
                        "announces it to routers)")
    r.add_argument("--health-host", default="127.0.0.1", help="where /health listens (0.0.0.0 in a container)")
    r.add_argument("--mini-of", default=None, metavar="MODEL",
                   help="serve this replica's model as the mini pool of MODEL (the main model's name, as its "
                        "replicas announce it): past a limit, gateways send MODEL's requests here")
    r.add_argument("--log-level", default="info", choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
    _safety_args(r, ("output",))
    r.set_defaults(func=cmd_replica)

    sb = sub.add_parser("sandbox", help="the code sandbox as a gRPC service (replicas reach it with --sandbox grpc://...)")
    sb.add_argument("--listen", default="127.0.0.1:50051", help="host:port (port 0 picks a free one)")
    sb.add_argument("--python", default="/usr/bin/python3", help="the system interpreter the sandbox runs code with")
    sb.add_argument("--max-concurrent", type=_count, default=8, help="runs at once; more wait")
    sb.add_argument("--per-tenant", type=_count, default=4, help="runs of one tenant at once")
    sb.add_argument("--log-level", default="info", choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
    sb.set_defaults(func=cmd_sandbox)
    from fairway.up import DEFAULT_DATABASE, DEFAULT_REDIS

    u = sub.add_parser("up", help="gateways and replicas on this machine, on the local Redis and PostgreSQL")
    u.add_argument("--replicas", type=_count, default=2, help="replica processes to start (default 2)")
    u.add_argument("--gateways", type=_count, default=2, help="gateway processes to start, on one port (default 2)")
    u.add_argument("--redis", default=os.environ.get("FAIRWAY_REDIS_URL", DEFAULT_REDIS),
                   help=f"redis://host:port/db (default: $FAIRWAY_REDIS_URL, else {DEFAULT_REDIS})")
    u.add_argument("--database", default=os.environ.get("FAIRWAY_DATABASE_URL", DEFAULT_DATABASE),
                   help=f"postgresql://user@host/db, made if missing (default: $FAIRWAY_DATABASE_URL, else "
                        f"{DEFAULT_DATABASE})")
    u.add_argument("--host", default="127.0.0.1", help="the address the gateways listen on (default 127.0.0.1)")
    u.add_argument("--port", type=_port, default=8000, help="the gateways' shared TCP port (default 8000)")
    u.add_argument("--namespace", default="fairway:", help="Redis key prefix")
    u.add_argument("--replica-arg", action="append", default=[], metavar="ARG",
                   help="passed on to every replica (repeat it: --replica-arg=--dtype --replica-arg=float32)")
    u.add_argument("--gateway-arg", action="append", default=[], metavar="ARG", help="passed on to every gateway")
    u.set_defaults(func=cmd_up)

    _fleet_args(sub)

    k = sub.add_parser("keys", help="API keys: create, revoke, list (in the conversation store's database)")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="{create,revoke,list}")
    database_help = "database URL (default: $FAIRWAY_DATABASE_URL, else SQLite in ./.fairway/)"
    kc = ksub.add_parser("create", help="a new key for a user; prints the key as its last line")
    kc.add_argument("--user", required=True, help="the user id the key's requests are served and counted as")
    kc.add_argument("--tier", default=Tier.FREE.value, choices=[tier.value for tier in Tier],
                    help=f"the user's limits and lane (default {Tier.FREE.value})")
    kc.add_argument("--name", default="", help="a note to tell keys apart")
    kc.add_argument("--region", default=None,
                    help="serve this key's requests in this region unless they name one (X-Fairway-Region)")
    kc.add_argument("--database", default=None, help=database_help)
    kr = ksub.add_parser("revoke", help="revoke a key, given the key itself or its id (key_...)")
    kr.add_argument("key", metavar="KEY_OR_ID", help="the key (sk-...) or its id (key_..., from keys list)")
    kr.add_argument("--database", default=None, help=database_help)
    kl = ksub.add_parser("list", help="the keys (ids, users, tiers; never the keys themselves)")
    kl.add_argument("--user", default=None, help="only this user's keys")
    kl.add_argument("--database", default=None, help=database_help)
    k.set_defaults(func=cmd_keys)
    return parser


def _check_window(args: argparse.Namespace) -> None:
    """--max-model-len against each model the command loads, from its metadata before the load
    (LlamaConfig.window: a ValueError past the model's context length, one line from main)."""
    if getattr(args, "max_model_len", None) is None:
        return
    from fairway.models.bundled import bundled_model_path
    from fairway.models.loader import read_config

    mini = getattr(args, "mini_model", None)  # (serve's mini pool runs in the same window)
    for model in [args.model, *([mini] if mini else [])]:
        path = Path(model) if model and model != "bundled" else bundled_model_path()
        read_config(path).window(args.max_model_len, "--max-model-len")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "device", "cpu") != "cpu":  # at start: a missing GPU is one line, not a first request's traceback
            from fairway.engine.device import check_device

            check_device(args.device)
        _check_window(args)
        return args.func(args)
    except ModelFileError as exc:  # a model file that is no model: refused at start, as a bad option is
        print(f"fairway: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad sampling parameters and the like: one line, no traceback
        print(f"fairway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop, as a shell command does
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
