"""Gateway CPU per chat request: this working tree against another revision, interleaved.

What a gateway spends to start and end a reply (auth, limits, store, context, job, subscription,
the final save, the replica's reports), apart from relaying tokens: short streamed chats
(max_tokens 2) through one `fairway gateway` process on Redis and a temporary PostgreSQL database
(or SQLite), with one synthetic replica (bench/relay.py's) as the model. The figure is the gateway
process's CPU (utime + stime) divided by the requests.

Two ways to send them: --concurrency N requests at all times (closed loop, the default), or
--rate R requests a second whatever the answers (open loop). Closed loop, how much work shares
a wake-up or a write depends on how fast the gateway answers, so the figure moves with the
machine's speed of the moment (+-10-15% here); at a fixed rate below saturation each round does
the same work, and rounds agree to a few percent. --gateway-arg passes an option to both sides'
gateways (--gateway-arg=--no-memory: what the memory lookup costs); --this-arg passes one to this tree's
gateway only (a part the base revision has not got, turned off).

Even so this machine's noise (a shared 2-core VM) is as large as many changes, so both sides run
in the same session, alternately, round after round: `--base` is checked out in a temporary git
worktree, and each side's own `fairway` and synthetic replica run from its tree. With --together
the two sides run at the same time instead, each with its own replica, database and share of the
client, so a round's two figures meet the same phase of the machine (their ratio moved +-3% from
round to round where alternate rounds moved +-10%); both then run on a busier machine, so their
figures are higher than alone. Prints a table and the medians; results go to
bench/results/gateway_requests.json (gateway_requests_together.json with --together).

    .venv/bin/python bench/gateway_requests.py --base HEAD~3           # 3 rounds of 800 requests
    .venv/bin/python bench/gateway_requests.py --base 4849222 --rounds 5 --database sqlite
    .venv/bin/python bench/gateway_requests.py --base 0ab41d4 --rate 150 --requests 1500
    .venv/bin/python bench/gateway_requests.py --base 0ab41d4 --rate 100 --requests 1500 --rounds 5 --together
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import relay  # noqa: E402  (this tree's helpers: ports, the SSE client, the temporary database)


async def measure(root: Path, args: argparse.Namespace, workdir: Path, own_args: list[str]) -> float:
    """Milliseconds of gateway CPU per request, for the tree at root."""
    async with relay.gateway_database(args.database, workdir) as database:
        api_key = relay.create_key(database, root)
        namespace = f"bench:{uuid.uuid4().hex[:8]}:"
        port = relay.free_port()
        procs = [relay.spawn(["bench/relay.py", "synthetic-replica", "--redis", args.redis, "--namespace", namespace],
                             workdir / "replica.log", root=root),
                 relay.spawn(["-m", "fairway.cli", "gateway", "--redis", args.redis, "--namespace", namespace,
                              "--database", database, "--port", str(port), "--log-level", "warning",
                              *relay.NO_LIMITS, *args.gateway_arg, *own_args], workdir / "gateway.log", root=root)]
        gateway = procs[-1]
        try:
            await relay.wait_ready(f"http://127.0.0.1:{port}")
            body = {"model": relay.MODEL, "messages": [{"role": "user", "content": "gateway benchmark"}],
                    "max_tokens": args.tokens, "stream": True}
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int = 0) -> int:
                if args.rate:  # open loop: request i leaves at i / rate s
                    await asyncio.sleep(i / args.rate)
                    return await relay.stream_chat(port, body, lambda data, received: None, api_key)
                async with gate:
                    return await relay.stream_chat(port, body, lambda data, received: None, api_key)

            await asyncio.gather(*(one() for _ in range(20)))  # warm-up: imports, connections, caches
            await asyncio.sleep(1.0)
            before = relay.cpu_seconds(gateway.pid)
            statuses = await asyncio.gather(*(one(i) for i in range(args.requests)))
            await asyncio.sleep(1.0)  # the replica's last reports, recorded
            cpu = relay.cpu_seconds(gateway.pid) - before
            if any(s != 200 for s in statuses):
                raise RuntimeError(f"{sum(s != 200 for s in statuses)} requests failed; see {workdir}")
            return cpu / args.requests * 1000
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=20)
            await relay._clean_redis(args.redis, namespace)


@contextlib.contextmanager
def worktree(rev: str, where: Path) -> Iterator[str]:
    """rev checked out at where for the block (its short hash), removed afterwards."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, check=True, capture_output=True,
                             text=True).stdout.strip()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, capture_output=True)


def this_tree() -> str:
    """This working tree's short hash, with " + changes" when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    return f"{head}{' + changes' if dirty else ''}"


def comparison_parser(doc: str, this_arg: bool = True) -> argparse.ArgumentParser:
    """The options of a benchmark that runs this tree against --base, round after round; with
    this_arg, options for this tree's processes alone."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the revision to compare with (default HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3)
    if this_arg:
        parser.add_argument("--this-arg", action="append", default=[],
                            help="an option for this tree's gateway or server only (repeatable): --this-arg=--no-memory "
                                 "turns off a part the base has not got")
    return parser


async def main(args: argparse.Namespace) -> None:
    relay.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="fairway-gw-bench-") as tmp, \
            worktree(args.base, Path(tmp) / "base") as base:
        base_root = Path(tmp) / "base"
        this = this_tree()
        rounds: list[dict[str, float]] = []
        load = f"{args.rate:g} a second" if args.rate else f"{args.concurrency} at once"
        print(f"gateway CPU per chat request ({args.requests} chats of {args.tokens} tokens, {load}, store "
              f"{args.database}{', gateway ' + ' '.join(args.gateway_arg) if args.gateway_arg else ''}): {base} vs "
              f"this tree ({this}{' ' + ' '.join(args.this_arg) if args.this_arg else ''})", flush=True)
        for r in range(args.rounds):
            sides = {}
            for side, root in (("base", base_root), ("this", ROOT)):
                workdir = Path(tmp) / f"{side}{r}"
                workdir.mkdir()
                sides[side] = (root, workdir, args.this_arg if side == "this" else [])
            if args.together:
                figures = await asyncio.gather(*(measure(root, args, wd, own) for root, wd, own in sides.values()))
            else:
                figures = [await measure(root, args, wd, own) for root, wd, own in sides.values()]
            result = {side: round(figure, 3) for side, figure in zip(sides, figures, strict=True)}
            rounds.append(result)
            print(f"  round {r + 1}: {base} {result['base']:6.2f} ms   this {result['this']:6.2f} ms", flush=True)
    medians = {side: round(statistics.median(r[side] for r in rounds), 3) for side in ("base", "this")}
    ratio = round(medians["this"] / medians["base"], 3)
    print(f"median: {base} {medians['base']:.2f} ms, this tree {medians['this']:.2f} ms per request "
          f"(this / base = {ratio})")
    ratios = [round(r["this"] / r["base"], 3) for r in rounds]
    print(f"this / base round by round: {', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")
    report: dict[str, Any] = {
        "benchmark": "gateway_requests",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(),
        "base": base, "this": this, "store": args.database, "requests": args.requests, "tokens": args.tokens,
        "concurrency": None if args.rate else args.concurrency, "rate_per_s": args.rate or None,
        "gateway_args": args.gateway_arg, "this_args": args.this_arg, "together": args.together, "rounds": rounds,
        "median_ms_per_request": medians, "this_over_base": ratio,
        "this_over_base_by_round": ratios, "median_of_ratios": statistics.median(ratios),
    }
    relay.RESULTS.mkdir(parents=True, exist_ok=True)
    name = "gateway_requests_together.json" if args.together else "gateway_requests.json"
    (relay.RESULTS / name).write_text(json.dumps(report, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    parser = comparison_parser(__doc__)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--concurrency", type=int, default=20, help="requests at all times (closed loop)")
    parser.add_argument("--rate", type=float, default=0.0, help="requests a second, open loop (instead of --concurrency)")
    parser.add_argument("--gateway-arg", action="append", default=[], help="an option for both gateways (repeatable)")
    parser.add_argument("--tokens", type=int, default=2, help="max_tokens per chat")
    parser.add_argument("--database", default="postgres", help="postgres (a temporary database), sqlite, or a URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--together", action="store_true",
                        help="both sides at the same time, each round (less of the machine's drift in the ratio)")
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop  # the client is this benchmark's own load: keep it cheap

    started = time.monotonic()
    uvloop.run(main(parse_args()))
    print(f"({time.monotonic() - started:.0f} s)")
