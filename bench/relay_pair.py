"""relay.py's relay part for this working tree and another revision at the same time: gateway CPU
per relayed event, paired level by level.

relay.py measures one tree. Two trees measured one after the other on a shared 2-core VM differ
by as much as the machine moves between runs, and the one that runs second meets what the first
left behind (its dropped database, Redis' freed memory): on one Zen 4 VM three alternated runs of
each put the same code 7-29% apart per event, always the second tree behind. Here both trees'
gateways, each with its own synthetic replicas (its tree's bench/relay.py), database and Redis
namespace, relay N streams each at the same time, so each level's two figures meet the same phase
of the machine and its ratio is the figure to read.

Each round runs, on both sides at once: steady arrivals (relay.py's headline: N streams at all
times, requests arriving at N / stream length a second; CPU per event all in), then all in 1 s
(N streams started within a second; CPU per event all in, and relaying alone while all run). The
medians of the rounds' ratios are printed, and those of the two sides' synthetic replicas' CPU over
each round (the same streams: the replica's cost per token, which on a shared machine is CPU the
gateway lacks). Results go to bench/results/relay_pair.json.

--in-turn runs each round's sides one after the other instead (the first alternating), each with
the machine to itself as in relay.py, at relay.py's N: bench/results/relay_pair_in_turn.json.

    .venv/bin/python bench/relay_pair.py --base 0ab41d4 --streams 400 --rounds 5 \\
        --this-arg=--no-memory --this-arg=--no-input-check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import relay  # noqa: E402  (this tree's client and level runners)
from gateway_requests import comparison_parser, this_tree, worktree  # noqa: E402

FIGURES = ("steady_arrivals", "all_in", "relaying_alone")  # us of gateway CPU per event


class Side:
    """One tree's gateway, its synthetic replicas and store, for the length of the run."""

    def __init__(self, name: str, root: Path, own_args: list[str]) -> None:
        self.name, self.root, self.own_args = name, root, own_args
        self.port = relay.free_port()
        self.namespace = f"bench:{uuid.uuid4().hex[:8]}:"
        self.key = ""
        self.procs: list[subprocess.Popen] = []

    async def start(self, args: argparse.Namespace, database: str, workdir: Path) -> None:
        self.key = relay.create_key(database, self.root)
        self.procs = [relay.spawn(["bench/relay.py", "synthetic-replica", "--redis", args.redis, "--namespace",
                                   self.namespace], workdir / f"producer{i}.log", root=self.root)
                      for i in range(args.producers)]
        self.procs.append(relay.spawn(["-m", "fairway.cli", "gateway", "--redis", args.redis, "--namespace",
                                       self.namespace, "--database", database, "--port", str(self.port),
                                       "--log-level", "warning", *relay.NO_LIMITS, *self.own_args],
                                      workdir / "gateway.log", root=self.root))
        await relay.wait_ready(f"http://127.0.0.1:{self.port}")
        await relay.relay_level(self.port, self.gateway_pid, 5, 10, self.key)  # warm-up

    @property
    def gateway_pid(self) -> int:
        return self.procs[-1].pid

    def replicas_cpu_s(self) -> float:
        return sum(relay.cpu_seconds(p.pid) for p in self.procs[:-1])

    async def round(self, streams: int, tokens: int) -> dict[str, Any]:
        replicas_before = self.replicas_cpu_s()
        steady = await relay.churn_level(self.port, self.gateway_pid, streams, tokens, self.key)
        burst = await relay.relay_level(self.port, self.gateway_pid, streams, tokens, self.key)
        replicas = self.replicas_cpu_s() - replicas_before
        per_event = {"steady_arrivals": steady["gateway_cpu_s_per_1000_events"],
                     "all_in": burst["gateway_cpu_s_per_1000_events"],
                     "relaying_alone": burst["steady_gateway_cpu_s_per_1000_events"]}
        return {"us_per_event": {k: round(v * 1000, 2) if v else None for k, v in per_event.items()},
                "p99_ms": {"steady_arrivals": steady["delay_p99_ms"], "all_in": burst["delay_p99_ms"]},
                "errors": steady["errors"] + burst["errors"],
                # The synthetic replicas' CPU over both levels: the same streams on both sides, so
                # the two compare directly (on a shared machine what they take, the gateway lacks).
                "replicas_cpu_s": round(replicas, 2)}

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=20)


async def run(args: argparse.Namespace, base_root: Path, tmp: Path) -> list[dict[str, dict[str, Any]]]:
    sides = [Side("base", base_root, args.gateway_arg), Side("this", ROOT, [*args.gateway_arg, *args.this_arg])]
    tokens = int(relay.RATE * args.duration)
    rounds = []
    async with contextlib.AsyncExitStack() as stack:
        for side in sides:
            workdir = tmp / f"side-{side.name}"
            workdir.mkdir()
            database = await stack.enter_async_context(relay.gateway_database(args.database, workdir))
            stack.callback(side.stop)
            await side.start(args, database, workdir)
        try:
            for r in range(args.rounds):
                if args.in_turn:  # one side at a time, the first of a round alternating (ABBA)
                    done = {}
                    for side in (sides if r % 2 == 0 else sides[::-1]):
                        before = await redis_cpu_s(args.redis)
                        done[side.name] = await side.round(args.streams, tokens)
                        # Redis serves only this side meanwhile: its CPU is this side's too.
                        done[side.name]["redis_cpu_s"] = round(await redis_cpu_s(args.redis) - before, 2)
                    base, this = done["base"], done["this"]
                else:
                    base, this = await asyncio.gather(*(side.round(args.streams, tokens) for side in sides))
                rounds.append({"base": base, "this": this})
                cells = "   ".join(f"{k} {base['us_per_event'][k]} / {this['us_per_event'][k]}" for k in FIGURES)
                redis_cpu = f"   Redis' CPU {base['redis_cpu_s']} / {this['redis_cpu_s']} s" if args.in_turn else ""
                print(f"  round {r + 1}: us per event, base / this: {cells}   replicas' CPU {base['replicas_cpu_s']} / "
                      f"{this['replicas_cpu_s']} s{redis_cpu}   (p99 ms {base['p99_ms']} / {this['p99_ms']}; errors "
                      f"{base['errors']} / {this['errors']})", flush=True)
        finally:
            for side in sides:
                await relay._clean_redis(args.redis, side.namespace)
    return rounds


async def redis_cpu_s(url: str) -> float:
    """The Redis server's CPU so far (user + system), from INFO."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        info = await client.info("cpu")
    finally:
        await client.aclose()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def side_ratios(rounds: list[dict[str, dict[str, Any]]], key: str) -> list[float]:
    """this / base of a per-side figure (CPU seconds), round by round."""
    return [round(r["this"][key] / r["base"][key], 3) for r in rounds if r["base"][key]]


def ratio(values: dict[str, Any], figure: str) -> float | None:
    base, this = values["base"]["us_per_event"][figure], values["this"]["us_per_event"][figure]
    return round(this / base, 3) if base and this else None


async def main(args: argparse.Namespace) -> None:
    relay.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="fairway-relay-pair-") as tmp, \
            worktree(args.base, Path(tmp) / "base") as base:
        this = this_tree()
        print(f"gateway CPU per relayed event, {args.streams} streams a side, "
              f"{'in turn' if args.in_turn else 'both at once'}: {base} vs this tree "
              f"({this}{' ' + ' '.join(args.this_arg) if args.this_arg else ''})", flush=True)
        rounds = await run(args, Path(tmp) / "base", Path(tmp))
    summary = {}
    for figure in FIGURES:
        ratios = [x for x in (ratio(r, figure) for r in rounds) if x is not None]
        if not ratios:  # (streams too short to measure relaying alone)
            continue
        medians = {side: statistics.median(v for r in rounds if (v := r[side]["us_per_event"][figure]))
                   for side in ("base", "this")}
        summary[figure] = {"median_us_per_event": medians, "this_over_base_by_round": ratios,
                           "median_of_ratios": statistics.median(ratios)}
        print(f"{figure}: median {medians['base']:.2f} vs {medians['this']:.2f} us per event; this / base by round "
              f"{', '.join(f'{x:.3f}' for x in ratios)}; median {summary[figure]['median_of_ratios']}")
    replicas = side_ratios(rounds, "replicas_cpu_s")
    if args.in_turn:
        redis_ratios = side_ratios(rounds, "redis_cpu_s")
        summary["redis_cpu"] = {"this_over_base_by_round": redis_ratios,
                                "median_of_ratios": statistics.median(redis_ratios)}
        print(f"Redis' CPU, this / base by round {', '.join(f'{x:.3f}' for x in redis_ratios)}; "
              f"median {statistics.median(redis_ratios)}")
    if replicas:
        summary["replicas_cpu"] = {"this_over_base_by_round": replicas, "median_of_ratios": statistics.median(replicas)}
        print(f"the synthetic replicas' CPU, this / base by round {', '.join(f'{x:.3f}' for x in replicas)}; "
              f"median {statistics.median(replicas)}")
    report = {"benchmark": "relay_pair", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "base": base, "this": this, "this_args": args.this_arg,
              "streams_per_side": args.streams, "in_turn": args.in_turn, "duration_s": args.duration, "producers_per_side": args.producers,
              "store": args.database, "rounds": rounds, "summary": summary}
    relay.RESULTS.mkdir(parents=True, exist_ok=True)
    name = "relay_pair_in_turn.json" if args.in_turn else "relay_pair.json"
    (relay.RESULTS / name).write_text(json.dumps(report, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    parser = comparison_parser(__doc__)
    parser.add_argument("--streams", type=int, default=400, help="streams each side relays at once")
    parser.add_argument("--gateway-arg", action="append", default=[], help="an option for both gateways (repeatable)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per stream")
    parser.add_argument("--producers", type=int, default=2, help="synthetic replica processes a side")
    parser.add_argument("--database", default="postgres", help="postgres (a temporary database a side) or sqlite")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--in-turn", action="store_true",
                        help="each round's two sides one after the other (first side alternating), not at once: "
                             "what each gateway costs with the machine to itself, as relay.py measures it")
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop  # the client is this benchmark's own load: keep it cheap

    started = time.monotonic()
    uvloop.run(main(parse_args()))
    print(f"({time.monotonic() - started:.0f} s)")
