"""The streaming path under load: how many SSE streams one gateway process relays, and what the
real model feels like through `fairway serve`.

Part 1, relay (Redis backend, real HTTP; the gateway's store a temporary PostgreSQL database, as at
scale, or `--database sqlite`): synthetic replica processes stand in for the model and
emit tokens at a fixed rate (30 tokens/s per reply), each token's text being the moment it was
produced. They step like a real engine: every 1/30 s one token for each of their replies, which
the replica worker appends in one pipelined round trip. N concurrent chat streams go through ONE
`fairway gateway` process; the client notes when each event arrives. Reported per N: the p50/p99
delay from token produced to event received (receive time minus the time in the token's text),
and the gateway's CPU-seconds per 1,000 events, two ways:

* all in: the gateway's CPU over the whole level, so each request's setup (auth, limits, store,
  context, job) and end (saving the reply, recording the replica's reports) is amortized over its
  tokens_per_stream events;
* steady: only while every stream is running, once all are set up: relaying events alone.

Each comes with the streams one gateway core would carry at that cost, 1000 / (30 * cpu_s_per_1000).

Each N runs two ways. Steady arrivals (the headline): N streams at all times, as a service
carrying N streams sees them: N client slots run streams back to back, their first starts spread
over one stream's length, so requests arrive at N / 10 s a second; measured over one stream's
length once all slots run (every event's delay, and the gateway's CPU for everything it did
meanwhile, per event, and its garbage collections: each stops every stream's events), and the
time from a request to its first event (where fewer than 97% of
the window's events came, it tells slow starts from replicas that fell behind their step clock,
as they do on a machine out of CPU). All in 1 s: the N streams start within one second (a flash
crowd on top of the streaming), measured as above (all in, and steady). The answer on this machine is the largest
N whose p99 <= 50 ms, for each. The steady level at that N runs --repeats times (3) in all, and
the streams per gateway core it reports is their median: this machine's noise moves one run's
figure by +-10%.

Part 2, model: `fairway serve` (bundled model, bf16, CPU) with 1, 16 and 64 concurrent chats of
128 tokens (distinct prompts, ignore_eos): TTFT p50/p99, inter-token latency p50/p99, aggregate
tokens/s. Then its peer, side by side in the same run: `transformers serve --continuous-batching`
on the same GGUF file, bf16 on the CPU, through the same client (--no-peer skips it).

    .venv/bin/python bench/relay.py                  # both parts (several minutes)
    .venv/bin/python bench/relay.py --part relay     # relay only
    .venv/bin/python bench/relay.py --quick          # smoke run: small N, short streams

Everything runs on this machine: client, gateway, synthetic replicas (and Redis) share its cores,
so the largest N is a floor for a gateway with a machine to itself; the streams per gateway core
are the figure to compare with the target. Results go to bench/results/relay.json
(relay_quick.json for --quick); a run of one part keeps the other part's last results there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)

RESULTS = ROOT / "bench" / "results"
MODEL = "smollm2-135m-instruct"
RATE = 30.0  # tokens/s per stream
P99_TARGET_MS = 50.0
TARGETS = {"relay_streams_per_gateway": 2000, "one_chat_tokens_per_s": 40, "sixteen_chats_tokens_per_s": 500,
           "sixteen_chats_ttft_p50_s": 0.5}


# -- helpers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children (gateway) inherit it


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None, root: Path = ROOT,
          exe: bool = True) -> subprocess.Popen:
    """A Python process of the tree at root (its fairway, its bench scripts); with exe=False, the
    command args as they are."""
    out = open(log, "wb")  # noqa: SIM115  lives as long as the process
    return subprocess.Popen([sys.executable, *args] if exe else args, stdout=out, stderr=subprocess.STDOUT,
                            cwd=root, env=os.environ | (env or {}))


# The load is this benchmark's own client: limits high enough that no request is throttled.
NO_LIMITS = ["--max-in-flight", "4000", "--max-waiting", "4000", "--ip-rpm", "10000000",
             "--rpm", "business=10000000", "--tpm", "business=1000000000",
             "--rpm", "paid=10000000", "--tpm", "paid=1000000000"]


def create_key(database: str, root: Path = ROOT) -> str:
    """A business-tier key in the gateway's store (`fairway keys create` prints it last)."""
    run = subprocess.run([sys.executable, "-m", "fairway.cli", "keys", "create", "--user", "bench", "--tier",
                          "business", "--database", database], capture_output=True, text=True, cwd=root, check=True)
    return run.stdout.strip().splitlines()[-1]


API_KEY = {"value": ""}  # set once the gateway's store has a key


async def scrape(client: Any, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{url}/metrics", timeout=10)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and all((k, v_) in ls for k, v_ in labels.items()))


async def gc_pauses(port: int) -> dict[str, float] | None:
    """The gateway's garbage collections so far, from its fairway:gc_pause_seconds histogram (all
    generations): how many, how many stopped it over 25 and 50 ms, their seconds; None from a
    gateway without the metric."""
    import httpx

    async with httpx.AsyncClient() as client:
        metrics = await scrape(client, f"http://127.0.0.1:{port}")
    name = "fairway:gc_pause_seconds"
    if not any(sample.startswith(name) for sample, _ in metrics):
        return None
    count = total(metrics, f"{name}_count")
    return {"count": count, "over_25ms": count - total(metrics, f"{name}_bucket", le="0.025"),
            "over_50ms": count - total(metrics, f"{name}_bucket", le="0.05"), "seconds": total(metrics, f"{name}_sum")}


def gc_window(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, float] | None:
    """The collections between two gc_pauses() readings."""
    if start is None or end is None:
        return None
    return {k: round(end[k] - start[k], 3) for k in end}


async def wait_ready(url: str, timeout: float = 180.0, path: str = "/ready") -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}{path}", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout} s")


# -- a raw SSE client: cheap enough that thousands of streams fit next to the gateway -----------


class SseClient(asyncio.Protocol):
    """One streaming chat over its own connection, parsed as bytes arrive: no reader task, no
    await per line. on_event(data_bytes, received_at) per SSE data line, received_at being the
    arrival of the bytes that completed its event."""

    def __init__(self, request: bytes, on_event: Callable[[bytes, float], None], done: asyncio.Future[int]) -> None:
        self.request = request
        self.on_event = on_event
        self.done = done
        self.status = 0
        self.chunked: bool | None = None  # None until the headers are in
        self.raw = b""  # bytes as received, not yet de-chunked
        self.body = b""  # de-chunked bytes not yet split into events
        self.chunk_left = -1  # bytes of the current chunk plus its CRLF still to come; -1: a size line is next
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        received = time.time()
        self.raw += data
        if self.chunked is None and not self._headers():
            return
        if self.chunked:
            self._dechunk()
        else:
            self.body, self.raw = self.body + self.raw, b""
        while (end := self.body.find(b"\n\n")) >= 0:
            event, self.body = self.body[:end], self.body[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    self.on_event(line[6:], received)

    def _headers(self) -> bool:
        end = self.raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = self.raw[:end].split(b"\r\n")
        self.raw = self.raw[end + 4:]
        self.status = int(lines[0].split()[1])
        self.chunked = any(line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
                           for line in lines[1:])
        return True

    def _dechunk(self) -> None:
        while True:
            if self.chunk_left < 0:
                eol = self.raw.find(b"\r\n")
                if eol < 0:
                    return
                size = int(self.raw[:eol].split(b";")[0] or b"0", 16)
                self.raw = self.raw[eol + 2:]
                if size == 0:  # the last chunk: the response is complete
                    assert self.transport is not None
                    self.transport.close()
                    return
                self.chunk_left = size + 2
            if len(self.raw) < self.chunk_left:
                return
            self.body += self.raw[: self.chunk_left - 2]
            self.raw = self.raw[self.chunk_left:]
            self.chunk_left = -1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.status)


async def stream_chat(port: int, body: dict[str, Any], on_event: Callable[[bytes, float], None],
                      api_key: str | None = None) -> int:
    """POST a streaming chat; on_event(data_bytes, received_at) per SSE data line. Returns status.
    With the key in API_KEY unless api_key names another (two gateways at once)."""
    payload = json.dumps(body).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Authorization: Bearer {api_key or API_KEY['value']}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: SseClient(request, on_event, done), "127.0.0.1", port)
    try:
        return await done
    finally:
        transport.close()


# -- part 1: the relay ----------------------------------------------------------------------------


class SyntheticEngine:
    """Stands in for AsyncEngine in a ReplicaWorker: max_tokens tokens at a fixed rate, each token's
    text the wall time it was produced. No model, so the relay is all that is measured.

    It steps like the real engine: every 1/rate s one token for every running reply, all at once,
    so the worker appends a step's tokens in one round trip (and the gateway gets them as the
    burst a real replica sends). An overloaded step clock falls behind rather than catching up."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.engine = SimpleNamespace(max_model_len=1 << 20, max_prompt_tokens=1 << 20,
                                      kv=SimpleNamespace(max_admissible_tokens=lambda: 1 << 20, block_size=16))
        self.last_stats = SimpleNamespace(kv_blocks_total=0, kv_blocks_used=0)  # what a heartbeat reports
        self.recent_blocks: tuple[int, ...] = ()  # no prefix cache
        self._aborted: set[str] = set()
        self._waiting: list[asyncio.Future[None]] = []  # replies waiting for the next step
        self._clock: asyncio.Task | None = None

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def _run_clock(self) -> None:
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            tick = max(tick + 1 / self.rate, loop.time())
            await asyncio.sleep(tick - loop.time())
            waiting, self._waiting = self._waiting, []
            for step in waiting:
                if not step.done():
                    step.set_result(None)

    async def _next_step(self) -> None:
        if self._clock is None:
            self._clock = asyncio.create_task(self._run_clock())
        step = asyncio.get_running_loop().create_future()
        self._waiting.append(step)
        await step

    async def generate(self, request_id, prompt_token_ids, params, priority=0, output_token_ids=None):
        from fairway.engine import FinishReason, RequestOutput

        for i in range(len(output_token_ids or []), params.max_tokens):  # (a continuation: after those)
            await self._next_step()
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                yield RequestOutput(request_id, None, "", FinishReason.ABORT, len(prompt_token_ids), 0, i)
                return
            last = i == params.max_tokens - 1
            yield RequestOutput(request_id, 100 + i, f"{time.time():.6f} ", FinishReason.LENGTH if last else None,
                                len(prompt_token_ids), 0, i + 1)


async def synthetic_replica(redis: str, namespace: str, rate: float) -> None:
    from fairway.relay import make_relay
    from fairway.replica.registry import make_registry
    from fairway.replica.worker import ReplicaSettings, ReplicaWorker
    from fairway.server_gc import settle_heap

    relay = make_relay(redis, prefix=namespace)
    registry = make_registry(redis, prefix=namespace)
    settings = ReplicaSettings(model=MODEL, max_inflight=100_000)
    worker = ReplicaWorker(SyntheticEngine(rate), relay, registry, settings)  # type: ignore[arg-type]
    settle_heap()  # as `fairway replica` does once its engine is loaded
    await worker.run()


def streams_per_core(cpu_s_per_1000_events: float | None) -> int | None:
    """Streams of RATE tokens/s that one core of gateway CPU relays at this cost per event."""
    return int(1000 / (RATE * cpu_s_per_1000_events)) if cpu_s_per_1000_events else None


def token_time(data: bytes) -> float | None:
    """The production time a synthetic token carries as its text (None for other chunks)."""
    marker = data.find(b'"content":"')
    if marker < 0:
        return None
    start = marker + 11
    text = data[start : data.find(b'"', start)].strip()
    return float(text) if text else None


async def relay_level(port: int, gateway_pid: int, n: int, tokens: int, api_key: str | None = None) -> dict[str, Any]:
    delays: list[float] = []
    events = 0
    per_stream = [0] * n  # content events each stream has received

    def on_event_of(i: int) -> Callable[[bytes, float], None]:
        def on_event(data: bytes, received: float) -> None:
            nonlocal events
            produced = token_time(data)
            if produced is None:
                return
            events += 1
            per_stream[i] += 1
            delays.append(received - produced)

        return on_event

    body = {"model": MODEL, "messages": [{"role": "user", "content": "relay benchmark"}], "max_tokens": tokens,
            "stream": True}

    async def one(i: int) -> int:
        await asyncio.sleep(i / n)  # spread the starts over a second, as real arrivals are
        # A stream that never ends (a lost final event) counts as an error instead of hanging the run.
        return await asyncio.wait_for(stream_chat(port, body, on_event_of(i), api_key), tokens / RATE + 60.0)

    async def steady() -> tuple[float, int] | None:
        """Gateway CPU and events while every stream is running: from 1 s after the last stream
        got its first event (all requests are set up) until the first stream is 1 s from its end.
        This is the cost of relaying events alone (heartbeats included), as far as the gateway's
        background work for the requests (recording their replicas' reports) has caught up."""
        while min(per_stream) == 0:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        cpu, seen, since = cpu_seconds(gateway_pid), events, time.monotonic()
        while max(per_stream) < tokens - RATE:
            await asyncio.sleep(0.05)
        if time.monotonic() - since < 2.0:
            return None  # too short to say
        return cpu_seconds(gateway_pid) - cpu, events - seen

    cpu_before = cpu_seconds(gateway_pid)
    started = time.monotonic()
    window = asyncio.ensure_future(steady())
    statuses = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - started
    cpu = cpu_seconds(gateway_pid) - cpu_before
    window.cancel()  # (done by now, unless a stream failed before its first event)
    steady_cpu, steady_events = (window.result() if window.done() and not window.cancelled() else None) or (0.0, 0)
    errors = sum(1 for s in statuses if s != 200)
    p99 = percentile(delays, 0.99) * 1000
    per_1000 = round(cpu / events * 1000, 4) if events else None
    steady_per_1000 = round(steady_cpu / steady_events * 1000, 4) if steady_events else None
    return {
        "streams": n,
        "tokens_per_stream": tokens,
        "events": events,
        "events_expected": n * tokens,
        "errors": errors,
        "delay_p50_ms": round(percentile(delays, 0.50) * 1000, 2),
        "delay_p99_ms": round(p99, 2),
        "delay_max_ms": round(max(delays, default=float("nan")) * 1000, 2),
        "gateway_cpu_s": round(cpu, 2),
        # Everything: the requests' setup (auth, limits, store, context, job) and end amortized
        # over their tokens_per_stream events, plus relaying the events.
        "gateway_cpu_s_per_1000_events": per_1000,
        "implied_streams_per_gateway_core": streams_per_core(per_1000),
        # Relaying alone, measured while all streams were running (see steady()).
        "steady_gateway_cpu_s_per_1000_events": steady_per_1000,
        "steady_implied_streams_per_gateway_core": streams_per_core(steady_per_1000),
        "wall_s": round(wall, 1),
        "ok": errors == 0 and events == n * tokens and p99 <= P99_TARGET_MS,
    }


async def churn_level(port: int, gateway_pid: int, n: int, tokens: int, api_key: str | None = None) -> dict[str, Any]:
    """N streams at all times, arriving as they would at steady state: N client slots, each
    running streams of `tokens` back to back, the slots' first starts spread over one stream's
    length (so requests arrive at N / stream length per second, not N in a burst). Measured over
    one stream's length once every slot is running: every event's delay, and the gateway's CPU,
    which covers the requests started meanwhile (setup and end) as well as the relaying."""
    length = tokens / RATE
    loop = asyncio.get_running_loop()
    begin = loop.time()
    window = (begin + length + 1.0, begin + 2 * length + 1.0)  # the measured span, loop time
    stop_starting = window[1]
    delays: list[float] = []
    first_event: list[float] = []  # request sent to first event, streams ending in the window
    cpu: dict[str, float] = {}
    statuses: list[int] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "relay benchmark"}], "max_tokens": tokens,
            "stream": True}

    def on_event(data: bytes, received: float) -> None:
        produced = token_time(data)
        if produced is not None and window[0] <= loop.time() < window[1]:
            delays.append(received - produced)

    def noting(seen: list[float]) -> Callable[[bytes, float], None]:
        """on_event, noting in seen when a stream's first event came."""
        def note(data: bytes, received: float) -> None:
            if not seen:
                seen.append(received)
            on_event(data, received)
        return note

    async def slot(i: int) -> None:
        await asyncio.sleep(i / n * length)
        while loop.time() < stop_starting:
            sent, seen = time.time(), []
            try:
                statuses.append(await asyncio.wait_for(stream_chat(port, body, noting(seen), api_key), length + 60.0))
            except (TimeoutError, OSError):
                statuses.append(0)
            if seen and window[0] <= loop.time() < window[1]:  # a slot's time between streams eats its events
                first_event.append(seen[0] - sent)

    gc: dict[str, dict[str, float] | None] = {}

    async def measure() -> None:
        await asyncio.sleep(window[0] - loop.time())
        cpu["start"] = cpu_seconds(gateway_pid)
        gc["start"] = await gc_pauses(port)
        await asyncio.sleep(window[1] - loop.time())
        cpu["end"] = cpu_seconds(gateway_pid)
        gc["end"] = await gc_pauses(port)

    await asyncio.gather(measure(), *(slot(i) for i in range(n)))
    errors = sum(1 for s in statuses if s != 200)
    expected = int(n * RATE * (window[1] - window[0]))
    per_1000 = round((cpu["end"] - cpu["start"]) / len(delays) * 1000, 4) if delays else None
    p99 = percentile(delays, 0.99) * 1000
    return {
        "streams": n,
        "arrivals": "steady",
        "tokens_per_stream": tokens,
        "requests_per_s": round(n / length, 1),
        "events_measured": len(delays),
        "events_expected": expected,
        "errors": errors,
        "delay_p50_ms": round(percentile(delays, 0.50) * 1000, 2),
        "delay_p99_ms": round(p99, 2),
        "delay_max_ms": round(max(delays, default=float("nan")) * 1000, 2),
        "first_event_p50_ms": round(percentile(first_event, 0.50) * 1000, 1),
        "first_event_p99_ms": round(percentile(first_event, 0.99) * 1000, 1),
        # The gateway's garbage collections in the window: each stops every stream's events.
        "gc_pauses": gc_window(gc.get("start"), gc.get("end")),
        # Everything the gateway did while N streams ran and N / length requests a second came
        # and went: per event relayed.
        "gateway_cpu_s_per_1000_events": per_1000,
        "implied_streams_per_gateway_core": streams_per_core(per_1000),
        "ok": errors == 0 and len(delays) >= 0.97 * expected and p99 <= P99_TARGET_MS,
    }


PG_SERVER = os.environ.get("FAIRWAY_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")


@contextlib.asynccontextmanager
async def gateway_database(choice: str, workdir: Path) -> AsyncIterator[str]:
    """The gateway's store: "postgres" (the default), a fresh database on PG_SERVER, which is what
    a gateway at scale uses, dropped afterwards (a temporary SQLite if that server is not there);
    "sqlite", a temporary SQLite file; anything else, that URL as it is."""
    if choice == "sqlite":
        yield f"sqlite:///{workdir}/relay.db"
        return
    if choice != "postgres":
        yield choice
        return
    import asyncpg

    name = f"fairway_bench_{uuid.uuid4().hex[:10]}"
    try:
        admin = await asyncpg.connect(f"{PG_SERVER}/postgres", timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"  (PostgreSQL at {PG_SERVER} unreachable: {exc}; the gateway uses SQLite)", flush=True)
        yield f"sqlite:///{workdir}/relay.db"
        return
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield f"{PG_SERVER}/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def bench_relay(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with gateway_database(args.database, workdir) as database:
        result = await relay_levels(args, workdir, database)
    return {"store": database.split(":", 1)[0], "gateway_args": args.gateway_arg, **result}


async def relay_levels(args: argparse.Namespace, workdir: Path, database: str) -> dict[str, Any]:
    namespace = f"bench:{uuid.uuid4().hex[:8]}:"
    port = free_port()
    API_KEY["value"] = create_key(database)
    procs = [spawn(["bench/relay.py", "synthetic-replica", "--redis", args.redis, "--namespace", namespace],
                   workdir / f"producer{i}.log") for i in range(args.producers)]
    gateway = spawn(["-m", "fairway.cli", "gateway", "--redis", args.redis, "--namespace", namespace, "--database",
                     database, "--port", str(port), "--log-level", "warning", *NO_LIMITS, *args.gateway_arg],
                    workdir / "gateway.log")
    procs.append(gateway)
    levels = [10, 25] if args.quick else [50, 100, 200, 400, 800, 1200, 1600, 2000, 2500, 3000]
    levels = [n for n in levels if n <= args.max_streams]
    tokens = int(RATE * (2 if args.quick else args.duration))
    results, churn = [], []
    try:
        await wait_ready(f"http://127.0.0.1:{port}")
        await relay_level(port, gateway.pid, 5, 10)  # warm-up: imports, connections, SQLite
        burst_ok = True
        for n in levels:
            steady = await churn_level(port, gateway.pid, n, tokens)
            churn.append(steady)
            print_steady(steady, f"({steady['requests_per_s']}/s)")
            if burst_ok:
                level = await relay_level(port, gateway.pid, n, tokens)
                results.append(level)
                burst_ok = level["ok"]
                print(f"  relay  N={n:5d}  all in 1 s          p50 {level['delay_p50_ms']:7.1f} ms  p99 "
                      f"{level['delay_p99_ms']:7.1f} ms  events {level['events']}/{level['events_expected']}  errors "
                      f"{level['errors']}  gateway {level['gateway_cpu_s_per_1000_events']} CPU-s/1000 events "
                      f"(~{level['implied_streams_per_gateway_core']} streams/core), steady "
                      f"{level['steady_gateway_cpu_s_per_1000_events']} "
                      f"(~{level['steady_implied_streams_per_gateway_core']} streams/core)", flush=True)
            if not steady["ok"] and not burst_ok:
                break
        # This machine's run-to-run noise is +-10%: the headline per-core figure is the median of
        # `repeats` runs of the largest passing steady level (this one and repeats - 1 more).
        churn_best = max((r for r in churn if r["ok"]), key=lambda r: r["streams"], default=None)
        repeats = [churn_best] if churn_best else []
        for i in range(1, args.repeats if churn_best and not args.quick else 1):
            again = await churn_level(port, gateway.pid, churn_best["streams"], tokens)
            repeats.append(again)
            print_steady(again, f"again ({i + 1}/{args.repeats})")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
        await _clean_redis(args.redis, namespace)
    passing = [r for r in results if r["ok"]]
    best = max(passing, key=lambda r: r["streams"], default=None)
    per_core = [r["implied_streams_per_gateway_core"] for r in repeats]
    return {"rate_tokens_per_s": RATE, "p99_target_ms": P99_TARGET_MS, "producers": args.producers,
            # N streams at all times, requests arriving at steady state (N / stream length a second).
            "largest_streams_within_target": churn_best["streams"] if churn_best else 0,
            # The median of the runs at that N (each run's figure in the list; the later ones'
            # levels in repeats_at_largest).
            "implied_streams_per_gateway_core": int(statistics.median(per_core)) if per_core else None,
            "implied_streams_per_gateway_core_runs": per_core,
            "repeats_at_largest": repeats[1:],
            # N streams all started within 1 s: a flash crowd on top of the streaming.
            "largest_streams_within_target_all_in_1_s": best["streams"] if best else 0,
            # At the largest passing N (the most load, so fixed costs weigh least): what one gateway
            # core would carry if it had a core to itself, all in / relaying alone.
            "implied_streams_per_gateway_core_all_in_1_s": best["implied_streams_per_gateway_core"] if best else None,
            "steady_implied_streams_per_gateway_core": best["steady_implied_streams_per_gateway_core"] if best else None,
            "levels_steady_arrivals": churn,
            "levels": results}


def print_steady(level: dict[str, Any], label: str) -> None:
    print(f"  relay  N={level['streams']:5d}  steady arrivals {label}  p50 {level['delay_p50_ms']:7.1f} ms  p99 "
          f"{level['delay_p99_ms']:7.1f} ms  events {level['events_measured']}/{level['events_expected']}  errors "
          f"{level['errors']}  first event p50/p99 {level['first_event_p50_ms']}/{level['first_event_p99_ms']} ms  "
          f"gateway {level['gateway_cpu_s_per_1000_events']} CPU-s/1000 events "
          f"(~{level['implied_streams_per_gateway_core']} streams/core){_gc_note(level.get('gc_pauses'))}", flush=True)


def _gc_note(pauses: dict[str, float] | None) -> str:
    if not pauses:
        return ""
    return (f"  gc {int(pauses['count'])} pauses ({int(pauses['over_25ms'])} over 25 ms, "
            f"{int(pauses['over_50ms'])} over 50 ms, {pauses['seconds'] * 1000:.0f} ms in all)")


async def _clean_redis(url: str, namespace: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    keys = [k async for k in r.scan_iter(match=f"{namespace}*", count=1000)]
    for i in range(0, len(keys), 500):
        await r.delete(*keys[i : i + 500])
    await r.aclose()


# -- part 2: the real model through `fairway serve` ---------------------------------------------


TOPICS = ["the sea", "volcanoes", "the Roman empire", "bread baking", "jazz", "chess", "bees", "glaciers",
          "the moon", "trains", "coffee", "origami", "whales", "deserts", "typography", "bicycles"]


NO_FINISH = (b'"finish_reason": null', b'"finish_reason":null')  # a token event's (the final one names its reason)


async def model_level(port: int, concurrency: int, tokens: int, model: str = MODEL,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    ttfts: list[float] = []
    gaps: list[float] = []
    counts: list[int] = []
    endings: dict[str, int] = {}  # finish_reason -> replies (a safety check may end one early)

    async def one(i: int) -> None:
        topic = TOPICS[i % len(TOPICS)]
        body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0.7, "seed": i,
                "messages": [{"role": "user", "content": f"Chat {i}: tell me something about {topic}."}],
                **(extra or {})}
        sent = time.time()
        times: list[float] = []

        def on_event(data: bytes, received: float) -> None:
            ends = b'"finish_reason"' in data and not any(null in data for null in NO_FINISH)
            if b'"content"' not in data and not ends:
                return
            choice = (json.loads(data).get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") and choice.get("finish_reason") is None:
                times.append(received)
            if choice.get("finish_reason"):
                endings[choice["finish_reason"]] = endings.get(choice["finish_reason"], 0) + 1

        await stream_chat(port, body, on_event)
        if times:
            ttfts.append(times[0] - sent)
            gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
        counts.append(len(times))

    started = time.time()
    await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.time() - started
    return {
        "concurrency": concurrency,
        "tokens_per_chat": tokens,
        "tokens": sum(counts),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "itl_p50_ms": round(percentile(gaps, 0.5) * 1000, 1),
        "itl_p99_ms": round(percentile(gaps, 0.99) * 1000, 1),
        "aggregate_tokens_per_s": round(sum(counts) / wall, 1),
        "wall_s": round(wall, 1),
        "finish_reasons": endings,
    }


async def bench_model(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from fairway.gateway.keys import generate_key

    levels = [1, 4] if args.quick else [1, 16, 64]
    tokens = 16 if args.quick else 128
    API_KEY["value"] = generate_key()  # `fairway serve` takes its development key from the environment
    port = free_port()
    fairway = spawn(["-m", "fairway.cli", "serve", "--port", str(port), "--database", f"sqlite:///{workdir}/serve.db",
                     "--log-level", "warning", *NO_LIMITS, *args.serve_arg], workdir / "serve.log",
                    env={"FAIRWAY_DEV_KEY": API_KEY["value"]})
    report: dict[str, Any] = {"serve_args": args.serve_arg,
                              "levels": await model_levels("fairway", fairway, port, levels, tokens,
                                                           extra={"ignore_eos": True})}
    if args.peer:
        # The peer, on the same GGUF file, workload and client: transformers' own OpenAI server
        # with continuous batching, bf16 on the CPU (it knows no ignore_eos: a chat may end
        # sooner; its tokens/s counts the tokens it sent).
        port, model = free_port(), str(peer_model(workdir))
        peer = spawn([str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
                      "--device", "cpu", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
                      "--log-level", "warning", model], workdir / "peer.log", env=OFFLINE, exe=False)
        report["peer"] = {"server": "transformers serve --continuous-batching (bf16, CPU)",
                          "levels": await model_levels("peer", peer, port, levels, tokens, "/health", model)}
        report["fairway_over_peer_tokens_per_s"] = ratios = {
            str(ours["concurrency"]): round(ours["aggregate_tokens_per_s"] / theirs["aggregate_tokens_per_s"], 2)
            for ours, theirs in zip(report["levels"], report["peer"]["levels"], strict=True)
            if theirs["aggregate_tokens_per_s"]}
        print("  fairway / peer, aggregate tokens/s: "
              + ", ".join(f"{c} chats {r}x" for c, r in ratios.items()), flush=True)
    return report


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# transformers serve reads a GGUF file's config without its architecture and fails, so the peer
# gets the same file as a model folder: loaded by transformers itself (gguf_file=), saved bf16.
_PEER_MODEL = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from fairway.models.bundled import bundled_model_path
gguf = bundled_model_path()
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(sys.argv[1])
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
config = loaded.config
config.__dict__.pop("quantization_config", None)  # (a GGUF-quantized model refuses to be saved)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())  # the dequantized weights
model.save_pretrained(sys.argv[1])
"""


def peer_model(workdir: Path) -> Path:
    out = workdir / "peer-model"
    subprocess.run([sys.executable, "-c", _PEER_MODEL, str(out)], cwd=ROOT, env=os.environ | OFFLINE, check=True,
                   capture_output=True)
    return out


async def model_levels(name: str, server: subprocess.Popen, port: int, levels: list[int], tokens: int,
                       ready_path: str = "/ready", model: str = MODEL,
                       extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    results = []
    try:
        await wait_ready(f"http://127.0.0.1:{port}", path=ready_path)
        await model_level(port, 2, 4, model, extra)  # warm-up (the peer's first request takes seconds)
        for c in levels:
            level = await model_level(port, c, tokens, model, extra)
            results.append(level)
            print(f"  {name:8s} {c:3d} chats  TTFT p50 {level['ttft_p50_s']:.2f} s p99 {level['ttft_p99_s']:.2f} s  "
                  f"ITL p50 {level['itl_p50_ms']:.0f} ms p99 {level['itl_p99_ms']:.0f} ms  "
                  f"{level['aggregate_tokens_per_s']:.1f} tokens/s  ({level['tokens']} tokens)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return results


# -- main -----------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    raise_fd_limit()
    report: dict[str, Any] = {
        "benchmark": "relay",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(),
        "targets": TARGETS,
        "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="fairway-bench-") as tmp:
        workdir = Path(tmp)
        if args.part in ("relay", "both"):
            print("relay: synthetic tokens at 30/s per stream through one gateway process (Redis)", flush=True)
            report["relay"] = await bench_relay(args, workdir)
        if args.part in ("model", "both"):
            print("model: fairway serve, bundled model bf16 on the CPU"
                  + (", then transformers serve on the same file" if args.peer else ""), flush=True)
            report["model"] = await bench_model(args, workdir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("relay_quick.json" if args.quick else "relay.json")
    out.write_text(json.dumps(keep_other_part(report, out), indent=2) + "\n")
    print(f"results: {out}")
    if args.part in ("relay", "both"):
        relay = report["relay"]
        print(f"largest N with p99 <= {P99_TARGET_MS:.0f} ms on this machine, steady arrivals: "
              f"{relay['largest_streams_within_target']} (~{relay['implied_streams_per_gateway_core']} streams per "
              f"gateway core, the median of {relay['implied_streams_per_gateway_core_runs']}); all started in 1 s: {relay['largest_streams_within_target_all_in_1_s']} "
              f"(~{relay['implied_streams_per_gateway_core_all_in_1_s']} all in, "
              f"{relay['steady_implied_streams_per_gateway_core']} relaying alone); target "
              f"{TARGETS['relay_streams_per_gateway']}")


def keep_other_part(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """The report plus the part this run skipped, as the last run that did it left it in `out`:
    `--part relay` must not erase the model figures (and vice versa). Each part carries its own date."""
    for part in ("relay", "model"):
        if part in report:
            report[part] = {"date": report["date"], **report[part]}
    try:
        previous = json.loads(out.read_text())
    except (OSError, ValueError):
        return report
    for part in ("relay", "model"):
        if part not in report and isinstance(previous.get(part), dict):
            report[part] = {"date": previous.get("date"), **previous[part]}  # older files: the file's date
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    replica = sub.add_parser("synthetic-replica", help="(internal) a replica process emitting synthetic tokens")
    replica.add_argument("--redis", required=True)
    replica.add_argument("--namespace", required=True)
    replica.add_argument("--rate", type=float, default=RATE)
    parser.add_argument("--part", choices=["relay", "model", "both"], default="both")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis", default=os.environ.get("FAIRWAY_REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument("--database", default="postgres",
                        help="the relay gateway's store: postgres (a temporary database on FAIRWAY_BENCH_PG, the "
                             "default), sqlite (a temporary file) or a URL")
    parser.add_argument("--producers", type=int, default=2, help="synthetic replica processes")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per stream at each N")
    parser.add_argument("--max-streams", type=int, default=3000)
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="model part: skip the peer (transformers serve) run")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="relay part: passed on to `fairway gateway` (--gateway-arg=--no-memory: a part an "
                             "older revision has not got, turned off to compare like with like)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="model part: passed on to `fairway serve` (--serve-arg=--safety-output --serve-arg=off)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of the largest passing steady level; the headline is their median")
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop  # the client and the synthetic replicas are this benchmark's own load: keep it cheap

    arguments = parse_args()
    if arguments.command == "synthetic-replica":
        uvloop.run(synthetic_replica(arguments.redis, arguments.namespace, arguments.rate))
    else:
        uvloop.run(main(arguments))
