"""The Redis client's fast paths, side by side with what they replace, in one run.

1. Commands: the CPU this process spends per command, with `--in-flight` commands outstanding
   at a time, through redis-py's asyncio client (its pool) and through fairway.redis_client's
   multiplexed connection (RedisClient.execute), against the same server.
2. Packing a token's append call: scripts.pack_call (generic, per argument by type) against
   scripts.pack_call_bytes (the replica's per-token path), the same bytes.

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

from fairway.redis_client import RedisClient, Script, pack_call
from fairway.redis_client.scripts import pack_call_bytes

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


def packing_part(calls: int) -> dict:
    script = Script("return 1")
    keys = ["fairway:reply:{rep_0123456789abcdef}", "fairway:reply:{rep_0123456789abcdef}:listened",
            "fairway:reply:{rep_0123456789abcdef}:live"]
    text, ids = " word", "1234"
    generic = [*keys, 17, 1800000, f"t{ids}\x1f{text}", "t", "text", text, "ids", ids]
    as_bytes = [a.encode() if isinstance(a, str) else str(a).encode() for a in generic]
    assert pack_call(script, keys, generic[3:]) == pack_call_bytes(script, as_bytes, 3)
    out = {}
    for name, fn in (("pack_call", lambda: pack_call(script, keys, generic[3:])),
                     ("pack_call_bytes", lambda: pack_call_bytes(script, as_bytes, 3))):
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
    packing = packing_part(200_000)
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
