"""Prefix-affinity routing against round-robin, on real replicas.

Workload (fixed): 40 conversations of 5 turns, all sharing one ~1,000-token system prompt, each
turn a ~100-token user message answered with --max-tokens tokens (greedy, ignore_eos, so both
sides generate the same amount). Conversation i starts at i * --spacing seconds, and each next
turn follows its reply after --think seconds, so arrivals spread over the run. Turns after the
first continue the stored conversation (conversation_id), as a chat client does.

Each routing runs on fresh processes in the same invocation: 2 `fairway replica` (the bundled
model on this machine's CPU, each serving /metrics) and 1 `fairway gateway --routing MODE`, on
Redis and a temporary PostgreSQL database. Per routing:

* prefix-cache hit rate: prompt tokens the replicas' engines found in their prefix caches over
  those they looked up (the engines' own counters, fairway:prefix_cache_hits / _queries, from each
  replica's /metrics, after a warm-up reply on each replica);
* TTFT p50/p99: from sending the request to its first content chunk, at the client;
* tokens/s: completion tokens over the wall time from the first request to the last reply;
* where the replies went (per replica) and why (the gateway's fairway:router_placements).

Each replica runs torch with --replica-threads threads (1: on 2 cores, two OpenMP pools of 2
would spin against each other). The gateways run without memory (--no-memory): its embeddings
would share the cores and are no part of routing.

On 2 CPU cores keep --max-tokens small (16 by default): the replicas share those cores. Prints a
table; results go to bench/results/routing.json. Two more phases, on fresh processes too (2
replicas, 1 gateway): "kill" SIGKILLs the replica holding most of 8 streamed replies once they
have their first tokens, --kills times (a fresh replica replaces it each time), and reports the
longest pause a stream saw (p50 and max over the kills) and whether every reply came whole (ids
1..N, [DONE]); "drain" SIGTERMs it instead, and reports the time the drain took to exit as well.
A phase is a function returning a dict of figures, listed in PHASES with its table columns.

    .venv/bin/python bench/routing.py
    .venv/bin/python bench/routing.py --conversations 8 --turns 3   # a quick look
    .venv/bin/python bench/routing.py --phases kill drain            # the failover pause and the drain
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import relay  # noqa: E402  (helpers: processes, ports, keys, the temporary database, percentiles, /metrics)

RESULTS = ROOT / "bench" / "results" / "routing.json"
ROUTINGS = ("affinity", "round-robin")
REGIONS = ("bench-a", "bench-b")  # one replica each, so the warm-up can reach each one


def system_prompt(tokens: int) -> str:
    """A handbook of numbered rules, about `tokens` tokens long in the bundled model's tokenizer."""
    from fairway.assembly import load_tokenizer

    tokenizer = load_tokenizer(None)
    rules: list[str] = []
    while len(tokenizer.encode(" ".join(rules))) < tokens:
        n = len(rules) + 1
        rules.append(f"Rule {n}: when a customer asks about order {1000 + n * 7}, check the ledger in aisle "
                     f"{n % 13} before answering, and mention the {['red', 'blue', 'green'][n % 3]} form.")
    return "You are the support assistant of a hardware store. Follow the handbook.\n" + "\n".join(rules)


def user_message(conversation: int, turn: int) -> str:
    """~100 tokens, different for every turn of every conversation."""
    return (f"Customer {conversation}, message {turn}: I bought item {conversation * 31 + turn} last week and "
            f"the packaging said it would fit shelf model {turn * 17 + conversation}. It did not fit; the "
            f"left bracket is {conversation % 5 + 2} millimetres too wide and the screws in bag "
            f"{turn + 3} are missing. I have the receipt number {conversation:04d}-{turn:02d}. Which rule "
            f"applies, and what should I bring to the store when I come on {['Monday', 'Friday'][turn % 2]}?")


@dataclass
class Turn:
    ttft_s: float | None
    completion_tokens: int
    ok: bool


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


async def chat(client: Any, url: str, key: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> tuple[Turn, str | None]:
    """One streamed turn: (its figures, the conversation id)."""
    sent = time.perf_counter()
    ttft, tokens, conversation, ok = None, 0, None, False
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}", **(headers or {})}) as r:
        if r.status_code != 200:
            print(f"  a turn failed: {r.status_code} {(await r.aread())[:200]!r}", flush=True)
            return Turn(None, 0, False), None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                ok = True
                break
            chunk = json.loads(data)
            conversation = conversation or chunk.get("conversation_id")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content") and ttft is None:
                ttft = time.perf_counter() - sent
    return Turn(ttft, tokens, ok), conversation


async def conversation(client: Any, url: str, key: str, i: int, args: argparse.Namespace, system: str,
                       run: Run) -> None:
    await asyncio.sleep(i * args.spacing)
    conversation_id = None
    for t in range(args.turns):
        messages = [{"role": "user", "content": user_message(i, t)}]
        if conversation_id is None:
            messages.insert(0, {"role": "system", "content": system})
        body = {"model": relay.MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                **({"conversation_id": conversation_id} if conversation_id else {})}
        turn, conversation_id = await chat(client, url, key, body)
        run.turns.append(turn)
        run.ended = time.perf_counter()
        if not turn.ok or conversation_id is None:
            return
        await asyncio.sleep(args.think)


async def routing_phase(routing: str, args: argparse.Namespace, workdir: Path, system: str) -> dict[str, Any]:
    """One routing on fresh replicas and gateway: the workload, and its figures."""
    import httpx

    namespace = f"bench:{uuid.uuid4().hex[:8]}:"
    async with relay.gateway_database(args.database, workdir) as database:
        key = relay.create_key(database)
        shared = ["--redis", args.redis, "--namespace", namespace]
        health_ports = [relay.free_port() for _ in REGIONS]  # a replica's /metrics is on its health port
        procs = [relay.spawn(["-m", "fairway.cli", "replica", *shared, "--region", region, "--replica-id",
                              f"{routing}-{region}", "--health-port", str(port), "--max-model-len", "4096",
                              "--log-level", "warning"], workdir / f"{routing}-{region}.log",
                             env={"OMP_NUM_THREADS": str(args.replica_threads)})
                 for region, port in zip(REGIONS, health_ports, strict=True)]
        port = relay.free_port()
        url = f"http://127.0.0.1:{port}"
        procs.append(relay.spawn(["-m", "fairway.cli", "gateway", *shared, "--database", database, "--port", str(port),
                                  "--routing", routing, "--log-level", "warning", "--no-memory", *relay.NO_LIMITS],
                                 workdir / f"{routing}-gateway.log"))
        try:
            await relay.wait_ready(url, timeout=300)
            async with httpx.AsyncClient(timeout=600) as client:
                while sum(m["replicas"] for m in (await client.get(f"{url}/v1/models", headers={
                        "Authorization": f"Bearer {key}"})).json()["data"]) < len(REGIONS):
                    await asyncio.sleep(0.5)
                for region in REGIONS:  # one reply on each replica first: its first forward pass is slow
                    warm = {"model": relay.MODEL, "messages": [{"role": "user", "content": "Warm up."}],
                            "max_tokens": 2, "stream": True}
                    await chat(client, url, key, warm, {"X-Fairway-Region": region})
                replicas = [f"http://127.0.0.1:{p}" for p in health_ports]
                before = [await relay.scrape(client, r) for r in replicas]
                run = Run(started=time.perf_counter())
                await asyncio.gather(*(conversation(client, url, key, i, args, system, run)
                                       for i in range(args.conversations)))
                after = [await relay.scrape(client, r) for r in replicas]
                gateway = await relay.scrape(client, url)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            await relay._clean_redis(args.redis, namespace)
    return figures(run, before, after, gateway)


def figures(run: Run, before: list[dict], after: list[dict], gateway: dict) -> dict[str, Any]:
    def delta(name: str) -> list[float]:
        return [relay.total(a, name) - relay.total(b, name) for b, a in zip(before, after, strict=True)]

    queries, hits = delta("fairway:prefix_cache_queries_total"), delta("fairway:prefix_cache_hits_total")
    ttfts = [t.ttft_s for t in run.turns if t.ttft_s is not None]
    tokens = sum(t.completion_tokens for t in run.turns)
    wall = run.ended - run.started
    reasons = {dict(labels)["reason"]: int(v) for (name, labels), v in gateway.items()
               if name == "fairway:router_placements_total"}
    return {
        "turns": len(run.turns), "failed": sum(not t.ok for t in run.turns),
        "prefix_cache_hit_rate": sum(hits) / sum(queries) if sum(queries) else None,
        "prompt_tokens_looked_up": int(sum(queries)), "prompt_tokens_from_cache": int(sum(hits)),
        "ttft_p50_s": relay.percentile(ttfts, 0.5), "ttft_p99_s": relay.percentile(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "tokens_per_s": tokens / wall if wall > 0 else None, "completion_tokens": tokens, "wall_s": wall,
        "replies_per_replica": [int(x) for x in delta("fairway:e2e_request_latency_seconds_count")],
        "placements": reasons,
    }


# -- failover and drain: a replica killed (or drained) under streamed replies --------------------


@dataclass
class Stream:
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ok: bool = False

    @property
    def longest_pause(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)

    @property
    def whole(self) -> bool:
        return self.ok and self.ids == list(range(1, len(self.ids) + 1))


async def event_stream(client: Any, url: str, key: str, body: dict[str, Any], s: Stream) -> None:
    """One streamed reply: every event's id and arrival time."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            return
        async for line in r.aiter_lines():
            if line.startswith("id:"):
                s.ids.append(int(line[3:].strip()))
                s.times.append(time.perf_counter())
            elif line.startswith("data:") and line[5:].strip() == "[DONE]":
                s.ok = True


def live_load(redis_url: str, namespace: str) -> dict[str, int]:
    """The live replicas' announced loads, by id (what the failover's registry holds)."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        found = {}
        for name in client.scan_iter(match=f"{namespace}replica:*"):
            raw = client.get(name)
            if raw:
                info = json.loads(raw)
                found[info["id"]] = info["load"]
        return found
    finally:
        client.close()


async def faults_phase(kind: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """`kind` "kill": --kills times, SIGKILL the replica holding most of --fault-streams streamed
    replies once each has its first tokens, then start a fresh replica; per kill, the longest
    pause any stream saw. "drain": the same with SIGTERM, once; the drain's time to exit."""
    import signal

    import httpx

    namespace = f"bench:{uuid.uuid4().hex[:8]}:"
    rounds = args.kills if kind == "kill" else 1
    pauses, took, whole, replies = [], [], 0, 0
    async with relay.gateway_database(args.database, workdir) as database:
        key = relay.create_key(database)
        shared = ["--redis", args.redis, "--namespace", namespace]
        replicas: dict[str, subprocess.Popen] = {}

        def start_replica(name: str) -> None:
            replicas[name] = relay.spawn(["-m", "fairway.cli", "replica", *shared, "--replica-id", name,
                                          "--max-model-len", "2048", "--drain-grace", "2", "--log-level", "warning"],
                                         workdir / f"{name}.log", env={"OMP_NUM_THREADS": str(args.replica_threads)})

        async def until_two_live() -> None:
            while len(live_load(args.redis, namespace)) < 2:
                await asyncio.sleep(0.2)

        for name in (f"{kind}-0", f"{kind}-1"):
            start_replica(name)
        port = relay.free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = relay.spawn(["-m", "fairway.cli", "gateway", *shared, "--database", database, "--port", str(port),
                               "--log-level", "warning", "--no-memory", *relay.NO_LIMITS], workdir / f"{kind}-gw.log")
        try:
            await relay.wait_ready(url, timeout=300)
            async with httpx.AsyncClient(timeout=600) as client:
                for r in range(rounds):
                    await until_two_live()
                    streams = [Stream() for _ in range(args.fault_streams)]
                    bodies = [{"model": relay.MODEL, "stream": True, "max_tokens": args.fault_tokens,
                               "temperature": 0, "ignore_eos": True,
                               "messages": [{"role": "user", "content": f"Round {r}: tell story number {i}."}]}
                              for i in range(len(streams))]
                    running = asyncio.gather(*(event_stream(client, url, key, b, s)
                                               for b, s in zip(bodies, streams, strict=True)))
                    while sum(len(s.ids) >= 3 for s in streams) < len(streams) // 2 and not running.done():
                        await asyncio.sleep(0.05)
                    loads = live_load(args.redis, namespace)
                    victim = max(loads, key=loads.__getitem__)
                    began = time.perf_counter()
                    replicas[victim].send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                    if kind == "drain":
                        await asyncio.to_thread(replicas[victim].wait, 120)
                        took.append(time.perf_counter() - began)
                    await running
                    pauses.append(max(s.longest_pause for s in streams))
                    whole += sum(s.whole for s in streams)
                    replies += len(streams)
                    print(f"  {kind} {r + 1}/{rounds}: {victim} (load {loads[victim]}), longest pause "
                          f"{pauses[-1]:.2f} s, {sum(s.whole for s in streams)}/{len(streams)} replies whole"
                          + (f", drained in {took[-1]:.2f} s" if took else ""), flush=True)
                    replicas[victim].wait(timeout=30)
                    start_replica(f"{kind}-{r + 2}")
        finally:
            for p in [*replicas.values(), gateway]:
                p.terminate()
            for p in [*replicas.values(), gateway]:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            await relay._clean_redis(args.redis, namespace)
    return {"rounds": rounds, "streams_per_round": args.fault_streams, "replies": replies, "replies_whole": whole,
            "pause_p50_s": statistics.median(pauses), "pause_max_s": max(pauses), "pauses_s": pauses,
            **({"drain_s": statistics.median(took)} if took else {})}


# A phase: (name, run(args, workdir, system) -> figures, the table's columns as (header, key, format)).
Phase = tuple[str, Callable[[argparse.Namespace, Path, str], Awaitable[dict[str, Any]]], list[tuple[str, str, str]]]
ROUTING_COLUMNS = [("hit rate", "prefix_cache_hit_rate", "{:.1%}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
                   ("TTFT p99 s", "ttft_p99_s", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
                   ("replies a/b", "replies_per_replica", "{}"), ("failed", "failed", "{}")]
FAULT_COLUMNS = [("pause p50 s", "pause_p50_s", "{:.2f}"), ("pause max s", "pause_max_s", "{:.2f}"),
                 ("replies whole", "replies_whole", "{}"), ("of", "replies", "{}"), ("drain s", "drain_s", "{:.2f}")]
PHASES: list[Phase] = [
    *[(routing, lambda args, workdir, system, routing=routing: routing_phase(routing, args, workdir, system),
       ROUTING_COLUMNS) for routing in ROUTINGS],
    *[(kind, lambda args, workdir, system, kind=kind: faults_phase(kind, args, workdir), FAULT_COLUMNS)
      for kind in ("kill", "drain")],
]


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per phase; a header wherever the columns change."""
    lines: list[str] = []
    shown = None
    for name, _, columns in PHASES:
        if name not in results:
            continue
        if columns is not shown:
            lines += ["", f"{'phase':<12} | " + " | ".join(header for header, _, _ in columns)]
            shown = columns
        cells = [fmt.format(results[name][k]) if results[name].get(k) is not None else "-" for _, k, fmt in columns]
        lines.append(f"{name:<12} | " + " | ".join(cells))
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    system = system_prompt(args.system_tokens)
    results: dict[str, dict[str, Any]] = {}
    if args.phases and RESULTS.exists():  # a run of some phases keeps the others' last figures
        results = json.loads(RESULTS.read_text()).get("results", {})
    with tempfile.TemporaryDirectory(prefix="fairway-routing-") as tmp:
        for name, run, _ in PHASES:
            if args.phases and name not in args.phases:
                continue
            print(f"{name} ...", flush=True)
            results[name] = await run(args, Path(tmp), system)
            print(f"  {results[name]}", flush=True)
    print(table(results))
    affinity, rr = results.get("affinity"), results.get("round-robin")
    summary = {}
    if affinity and rr and affinity["ttft_p50_s"] and rr["ttft_p50_s"]:
        summary = {"ttft_p50_round_robin_over_affinity": rr["ttft_p50_s"] / affinity["ttft_p50_s"],
                   "targets": {"affinity_hit_rate": 0.8, "ttft_p50_round_robin_over_affinity": 2.0}}
        print(f"TTFT p50: round-robin / affinity = {summary['ttft_p50_round_robin_over_affinity']:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(),
        "workload": {"conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
                     "max_tokens": args.max_tokens, "spacing_s": args.spacing, "think_s": args.think,
                     "replicas": len(REGIONS), "replica_threads": args.replica_threads, "model": relay.MODEL},
        "results": results, **summary,
    }, indent=2) + "\n")
    print(f"results: {RESULTS.relative_to(ROOT)}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (keep it small on 2 cores)")
    p.add_argument("--spacing", type=float, default=1.5, help="seconds between conversations' starts")
    p.add_argument("--think", type=float, default=0.5, help="seconds between a reply and the next turn")
    p.add_argument("--replica-threads", type=int, default=1,
                   help="torch threads per replica (1: each of the 2 replicas has a core of a 2-core machine)")
    p.add_argument("--kills", type=int, default=5, help="kill phase: replicas SIGKILLed, one at a time")
    p.add_argument("--fault-streams", type=int, default=8, help="kill and drain phases: streamed replies at once")
    p.add_argument("--fault-tokens", type=int, default=48, help="kill and drain phases: tokens per reply")
    p.add_argument("--phases", nargs="*", default=None, help=f"run only these ({', '.join(n for n, _, _ in PHASES)})")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    p.add_argument("--database", default="postgres", help="postgres (a temporary database), sqlite, or a URL")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
