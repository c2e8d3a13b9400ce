"""The Redis client's fast paths, side by side with what they replace, in one run.

1. Commands: the CPU this process spends per command, with `--in-flight` commands outstanding
   at a time, through redis-py's asyncio client (its pool) and through fairway.redis_client's
   multiplexed connection (RedisClient.execute), against the same server.
2. Packing a token's part of an append call: the generic scripts.pack_args (per argument by
   type, as every other event's part) against the replica's per-token path (the part's
   scripts.args_format filled in one step), the same bytes.

    .venv/bin/python bench/redis_client.py [--redis redis://127.0.0.1:6379/0] [--commands 20000]

Prints a table and writes bench/results/redis_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import machine  # bench/machine.py: this script's folder is on the path
import redis.asyncio as aioredis

from fairway.redis_client import RedisClient
from fairway.relay import TokenEvent, make_relay

RESULTS = Path(__file__).parent / "results" / "redis_client.json"


async def cpu_per_command(call, commands: int, in_flight: int) -> float:
    """Process CPU microseconds per command, in_flight at a time."""
    await call()  # connect first
    queue = iter(range(commands))

    async def worker() -> None:
        for _ in queue:
            await call()

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return (time.process_time() - start) / commands * 1e6


async def commands_part(url: str, commands: int, in_flight: int, repeats: int) -> dict:
    key = f"bench:redis_client:{time.time_ns()}"
    py = aioredis.from_url(url, decode_responses=True)
    ours = RedisClient(url)
    figures: dict[str, list[float]] = {"redis-py": [], "fairway": []}
    try:
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
            figures["redis-py"].append(await cpu_per_command(lambda: py.get(key), commands, in_flight))
            figures["fairway"].append(await cpu_per_command(lambda: ours.execute("GET", key), commands, in_flight))
    finally:
        await py.aclose()
        await ours.close()
    return {name: {"runs_us": runs, "median_us": statistics.median(runs)} for name, runs in figures.items()}


def packing_part(redis_url: str, calls: int) -> dict:
    """A token's part of an append call as the replica packs it (RedisTokenLog._token_part: the
    part's formats filled in one step each) and as every other event's is (_event_part: the
    generic pack_args)."""
    log = make_relay(redis_url).log  # (no connection is made: packing only)
    event = TokenEvent(17, " word", [1234])
    assert log._token_part("rep_0123456789abcdef", event) == log._event_part("rep_0123456789abcdef", event)
    out = {}
    for name, fn in (("pack_args", lambda: log._event_part("rep_0123456789abcdef", event)),
                     ("args_format filled", lambda: log._token_part("rep_0123456789abcdef", event))):
        start = time.process_time()
        for _ in range(calls):
            fn()
        out[name] = {"us_per_call": (time.process_time() - start) / calls * 1e6}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--commands", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    commands = asyncio.run(commands_part(args.redis, args.commands, args.in_flight, args.repeats))
    packing = packing_part(args.redis, 200_000)
    ratio = commands["redis-py"]["median_us"] / commands["fairway"]["median_us"]
    print(f"{'CPU per command, ' + str(args.in_flight) + ' in flight':<40} {'median us':>10}  runs")
    for name, fig in commands.items():
        print(f"{name:<40} {fig['median_us']:>10.1f}  {' / '.join(f'{r:.1f}' for r in fig['runs_us'])}")
    print(f"{'redis-py / fairway':<40} {ratio:>10.2f}x")
    for name, fig in packing.items():
        print(f"{'packing a token append: ' + name:<40} {fig['us_per_call']:>10.2f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"timestamp": time.time(), "machine": machine.describe(), "in_flight": args.in_flight,
                                   "commands": commands, "redis_py_over_fairway": ratio, "packing": packing},
                                  indent=2) + "\n")


if __name__ == "__main__":
    main()
