"""The streaming path under load: how many SSE streams one gateway process relays, and what the
real model feels like through `fairway serve`.

Part 1, relay (Redis backend, real HTTP): synthetic replica processes stand in for the model and
emit tokens at a fixed rate (30 tokens/s per reply), each token's text being the moment it was
produced. N concurrent chat streams go through ONE `fairway gateway` process; the client notes
when each event arrives. Reported per N: the p50/p99 delay from token produced to event received,
and the gateway's CPU-seconds per 1,000 events. The answer is the largest N whose p99 <= 50 ms.

Part 2, model: `fairway serve` (bundled model, bf16, CPU) with 1, 16 and 64 concurrent chats of
128 tokens (distinct prompts, ignore_eos): TTFT p50/p99, inter-token latency p50/p99, aggregate
tokens/s.

    .venv/bin/python bench/relay.py                  # both parts (several minutes)
    .venv/bin/python bench/relay.py --part relay     # relay only
    .venv/bin/python bench/relay.py --quick          # smoke run: small N, short streams

Everything runs on this machine: client, gateway, synthetic replicas (and Redis) share its cores,
so the relay figure is a floor for a gateway with a machine to itself. Results go to
bench/results/relay.json (relay_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    out = open(log, "wb")  # noqa: SIM115  lives as long as the process
    return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | (env or {}))


# The load is this benchmark's own client: limits high enough that no request is throttled.
NO_LIMITS = ["--max-in-flight", "4000", "--max-waiting", "4000", "--ip-rpm", "10000000",
             "--rpm", "business=10000000", "--tpm", "business=1000000000",
             "--rpm", "paid=10000000", "--tpm", "paid=1000000000"]


def create_key(database: str) -> str:
    """A business-tier key in the gateway's store (`fairway keys create` prints it last)."""
    run = subprocess.run([sys.executable, "-m", "fairway.cli", "keys", "create", "--user", "bench", "--tier",
                          "business", "--database", database], capture_output=True, text=True, cwd=ROOT, check=True)
    return run.stdout.strip().splitlines()[-1]


API_KEY = {"value": ""}  # set once the gateway's store has a key


async def wait_ready(url: str, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}/ready", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout} s")


# -- a raw SSE client: cheap enough that thousands of streams fit next to the gateway -----------


async def stream_chat(port: int, body: dict[str, Any], on_event) -> int:
    """POST a streaming chat; on_event(data_bytes, received_at) per SSE data line. Returns status."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(
        (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {API_KEY['value']}\r\n"
         f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        + payload
    )
    await writer.drain()
    try:
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(1 << 16)
                if not data:
                    break
            now = time.time()
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        on_event(line[6:], now)
        return status
    finally:
        writer.close()


# -- part 1: the relay ----------------------------------------------------------------------------


class SyntheticEngine:
    """Stands in for AsyncEngine in a ReplicaWorker: max_tokens tokens at a fixed rate, each token's
    text the wall time it was produced. No model, so the relay is all that is measured."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.engine = SimpleNamespace(max_model_len=1 << 20, max_prompt_tokens=1 << 20,
                                      kv=SimpleNamespace(max_admissible_tokens=lambda: 1 << 20))
        self._aborted: set[str] = set()

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def generate(self, request_id, prompt_token_ids, params, priority=0):
        from fairway.engine import FinishReason, RequestOutput

        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(params.max_tokens):
            await asyncio.sleep(max(0.0, start + (i + 1) / self.rate - loop.time()))
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                yield RequestOutput(request_id, None, "", FinishReason.ABORT, len(prompt_token_ids), 0, i)
                return
            last = i == params.max_tokens - 1
            yield RequestOutput(request_id, 100 + i, f"{time.time():.6f} ", FinishReason.LENGTH if last else None,
                                len(prompt_token_ids), 0, i + 1)


async def synthetic_replica(redis: str, namespace: str, rate: float) -> None:
    from fairway.relay import make_token_log
    from fairway.replica.worker import ReplicaSettings, ReplicaWorker
    from fairway.router import make_registry

    token_log = make_token_log(redis, prefix=namespace)
    registry = make_registry(redis, prefix=namespace)
    settings = ReplicaSettings(model=MODEL, max_inflight=100_000)
    await ReplicaWorker(SyntheticEngine(rate), token_log, registry, settings).run()  # type: ignore[arg-type]


async def relay_level(port: int, gateway_pid: int, n: int, tokens: int) -> dict[str, Any]:
    delays: list[float] = []
    events = 0
    first_event_at: list[float] = []

    def on_event(data: bytes, received: float) -> None:
        nonlocal events
        marker = data.find(b'"content":"')
        if marker < 0:
            return
        start = marker + 11
        text = data[start : data.find(b'"', start)].strip()
        if not text:
            return
        events += 1
        if not first_event_at:
            first_event_at.append(received)
        delays.append(received - float(text))

    body = {"model": MODEL, "messages": [{"role": "user", "content": "relay benchmark"}], "max_tokens": tokens,
            "stream": True}

    async def one(i: int) -> int:
        await asyncio.sleep(i / n)  # spread the starts over a second, as real arrivals are
        return await stream_chat(port, body, on_event)

    cpu_before = cpu_seconds(gateway_pid)
    started = time.monotonic()
    statuses = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - started
    cpu = cpu_seconds(gateway_pid) - cpu_before
    errors = sum(1 for s in statuses if s != 200)
    p99 = percentile(delays, 0.99) * 1000
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
        "gateway_cpu_s_per_1000_events": round(cpu / events * 1000, 3) if events else None,
        "wall_s": round(wall, 1),
        "ok": errors == 0 and events == n * tokens and p99 <= P99_TARGET_MS,
    }


async def bench_relay(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    namespace = f"bench:{uuid.uuid4().hex[:8]}:"
    port = free_port()
    database = args.database or f"sqlite:///{workdir}/relay.db"
    API_KEY["value"] = create_key(database)
    procs = [spawn(["bench/relay.py", "synthetic-replica", "--redis", args.redis, "--namespace", namespace],
                   workdir / f"producer{i}.log") for i in range(args.producers)]
    gateway = spawn(["-m", "fairway.cli", "gateway", "--redis", args.redis, "--namespace", namespace, "--database",
                     database, "--port", str(port), "--log-level", "warning", *NO_LIMITS], workdir / "gateway.log")
    procs.append(gateway)
    levels = [10, 25] if args.quick else [50, 100, 200, 400, 800, 1200, 1600, 2000, 2500, 3000]
    levels = [n for n in levels if n <= args.max_streams]
    tokens = int(RATE * (2 if args.quick else args.duration))
    results = []
    try:
        await wait_ready(f"http://127.0.0.1:{port}")
        await relay_level(port, gateway.pid, 5, 10)  # warm-up: imports, connections, SQLite
        for n in levels:
            level = await relay_level(port, gateway.pid, n, tokens)
            results.append(level)
            print(f"  relay  N={n:5d}  p50 {level['delay_p50_ms']:8.1f} ms  p99 {level['delay_p99_ms']:8.1f} ms  "
                  f"events {level['events']}/{level['events_expected']}  errors {level['errors']}  "
                  f"gateway {level['gateway_cpu_s_per_1000_events']} CPU-s/1000 events", flush=True)
            if not level["ok"]:
                break
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
        await _clean_redis(args.redis, namespace)
    passing = [r["streams"] for r in results if r["ok"]]
    return {"rate_tokens_per_s": RATE, "p99_target_ms": P99_TARGET_MS, "producers": args.producers,
            "largest_streams_within_target": max(passing, default=0), "levels": results}


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


async def model_level(port: int, concurrency: int, tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    gaps: list[float] = []
    counts: list[int] = []

    async def one(i: int) -> None:
        topic = TOPICS[i % len(TOPICS)]
        body = {"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.7,
                "seed": i, "messages": [{"role": "user", "content": f"Chat {i}: tell me something about {topic}."}]}
        sent = time.time()
        times: list[float] = []

        def on_event(data: bytes, received: float) -> None:
            if b'"content":' in data and b'"finish_reason":null' in data:
                times.append(received)

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
    }


async def bench_model(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    port = free_port()
    from fairway.gateway.keys import generate_key

    API_KEY["value"] = generate_key()  # `fairway serve` takes its development key from the environment
    server = spawn(["-m", "fairway.cli", "serve", "--port", str(port), "--database", f"sqlite:///{workdir}/serve.db",
                    "--log-level", "warning", *NO_LIMITS], workdir / "serve.log", env={"FAIRWAY_DEV_KEY": API_KEY["value"]})
    levels = [1, 4] if args.quick else [1, 16, 64]
    tokens = 16 if args.quick else 128
    results = []
    try:
        await wait_ready(f"http://127.0.0.1:{port}")
        await model_level(port, 2, 4)  # warm-up
        for c in levels:
            level = await model_level(port, c, tokens)
            results.append(level)
            print(f"  model  {c:3d} chats  TTFT p50 {level['ttft_p50_s']:.2f} s p99 {level['ttft_p99_s']:.2f} s  "
                  f"ITL p50 {level['itl_p50_ms']:.0f} ms p99 {level['itl_p99_ms']:.0f} ms  "
                  f"{level['aggregate_tokens_per_s']:.1f} tokens/s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"levels": results}


# -- main -----------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    raise_fd_limit()
    report: dict[str, Any] = {
        "benchmark": "relay",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "targets": TARGETS,
        "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="fairway-bench-") as tmp:
        workdir = Path(tmp)
        if args.part in ("relay", "both"):
            print("relay: synthetic tokens at 30/s per stream through one gateway process (Redis)", flush=True)
            report["relay"] = await bench_relay(args, workdir)
        if args.part in ("model", "both"):
            print("model: fairway serve, bundled model bf16 on the CPU", flush=True)
            report["model"] = await bench_model(args, workdir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("relay_quick.json" if args.quick else "relay.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {out}")
    if "relay" in report:
        print(f"largest N with p99 <= {P99_TARGET_MS:.0f} ms: {report['relay']['largest_streams_within_target']}"
              f" (target {TARGETS['relay_streams_per_gateway']})")


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
    parser.add_argument("--database", default=None, help="store URL for the gateway (default: a temporary SQLite)")
    parser.add_argument("--producers", type=int, default=2, help="synthetic replica processes")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per stream at each N")
    parser.add_argument("--max-streams", type=int, default=3000)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.command == "synthetic-replica":
        asyncio.run(synthetic_replica(arguments.redis, arguments.namespace, arguments.rate))
    else:
        asyncio.run(main(arguments))
