"""The conversation store's chat path on PostgreSQL: CPU per chat, this tree against another
revision, interleaved.

What a gateway asks of the store for each chat request, against the real PostgreSQL: the new
turn (conversation, message, queued reply), the replica's start, the gateway's save of the reply,
the recorder's second save and the accounting (a batch of replies' jobs read, their usage
stored), and the next turn's reads (the conversation, its history). Chats run `--concurrency` at
a time, the batch calls once per batch, as the recorder does. The figure is the client process's
CPU (what a gateway spends) per chat; the wall time per chat is printed too.

Three sides, run alternately round after round in the same session (this machine's noise moves
one run by +-10%): `--base` checked out in a temporary git worktree, this tree, and this tree
with the chat path's statements sent through SQLAlchemy's engine instead (the store as it runs
on SQLite: a transaction around each write). Each side runs in a process of its own importing
its own tree's `fairway`. Prints a table and the medians; results go to
bench/results/store_requests.json.

    .venv/bin/python bench/store_requests.py --base main            # 3 rounds of 2000 chats
    .venv/bin/python bench/store_requests.py --base HEAD~1 --rounds 5 --chats 4000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gateway_requests  # noqa: E402  (its worktree(), this_tree(), comparison_parser())
import machine  # noqa: E402
import relay  # noqa: E402  (the temporary database, the results folder)

SIDES = ("base", "this", "engine")


async def chats(database: str, args: argparse.Namespace, through_engine: bool) -> dict[str, float]:
    """Run the chats on the fairway importable here; CPU and wall milliseconds per chat."""
    from fairway.conversation import Conversation, MessageStatus, Role, UsageRecord, make_store
    from fairway.conversation.entities import new_id, now
    from fairway.conversation.store import Ending, NewTurn

    store = make_store(database)
    await store.init()
    if through_engine:
        # The store's own fallback: with no hot path, each statement goes through the engine.
        for name in ("_hot_path", "_direct"):  # (this tree's name, and pg_direct's before it)
            if getattr(store, name, None) is not None:
                setattr(store, name, None)
                break
        else:
            raise RuntimeError("this store has no hot path to turn off")
    job = {"model": "smollm2", "sampling": {"max_tokens": 64, "temperature": 0.7}, "lane": "paid",
           "meta": {"user": "bench-user", "tier": "paid"}}
    prompt = list(range(200))

    async def start(i: int) -> tuple[Conversation, Any]:
        ts = now()
        conversation = Conversation(new_id("conv"), "bench-user", "paid", "smollm2", "a title", ts, ts)
        _, reply = await store.store_turn(NewTurn(conversation, True, [(Role.SYSTEM, "Be brief."),
                                                                        (Role.USER, f"question {i}")],
                                                  f"key-{i}", prompt, None, job))
        return conversation, reply

    async def next_turn_reads(conversation: Conversation) -> None:
        await store.get_conversation(conversation.id, "bench-user")
        await store.list_messages(conversation.id)

    async def batch(first: int) -> None:
        started = await asyncio.gather(*(start(first + i) for i in range(args.concurrency)))
        ids = [reply.id for _, reply in started]
        await store.mark_running_many([(reply_id, "replica-1") for reply_id in ids])
        endings = [Ending(reply_id, "An answer of a few words.", MessageStatus.COMPLETE, "stop", 210, 7, 192, 8)
                   for reply_id in ids]
        await asyncio.gather(*(store.finish_reply(e.reply_id, e.text, e.status, e.finish_reason,
                                                  prompt_tokens=e.prompt_tokens, completion_tokens=e.completion_tokens,
                                                  cached_tokens=e.cached_tokens, last_event_id=e.last_event_id,
                                                  look_up_existing=False) for e in endings))
        await store.finish_replies(endings)  # the recorder's save, second: changes nothing
        jobs = await store.get_reply_jobs(ids)
        ts = now()
        await store.add_usage_many([UsageRecord(id=new_id("usage"), reply_id=reply_id, user_id="bench-user",
                                                model=jobs[reply_id]["model"], tier="paid", prompt_tokens=210,
                                                cached_tokens=192, completion_tokens=7, ttft_s=0.1, duration_s=0.3,
                                                finish_reason="stop", cost=0.0001, created_at=ts, day="2026-12-01")
                                    for reply_id in ids])
        await asyncio.gather(*(next_turn_reads(conversation) for conversation, _ in started))

    try:
        for b in range(5):  # warm-up: connections, prepared statements, compiled SQL
            await batch(-(b + 1) * args.concurrency)
        cpu, wall = time.process_time(), time.perf_counter()
        for first in range(0, args.chats, args.concurrency):
            await batch(first)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await store.close()
    return {"cpu_ms": cpu / args.chats * 1000, "wall_ms": wall / args.chats * 1000}


async def measure(side: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    """One side's run in a process of its own, on a fresh database."""
    async with relay.gateway_database("postgres", Path(tempfile.gettempdir())) as database:
        if not database.startswith("postgresql"):
            raise RuntimeError("this benchmark needs PostgreSQL")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", database, "--chats", str(args.chats),
                   "--concurrency", str(args.concurrency), *(["--through-engine"] if side == "engine" else [])]
        env = {**os.environ, "PYTHONPATH": str(root)}
        out = await asyncio.to_thread(subprocess.run, command, cwd=root, env=env, check=True, capture_output=True,
                                      text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fairway-store-bench-") as tmp:
        base_root = Path(tmp) / "base"
        this = gateway_requests.this_tree()
        roots = {"base": base_root, "this": ROOT, "engine": ROOT}
        rounds: list[dict[str, dict[str, float]]] = []
        with gateway_requests.worktree(args.base, base_root) as base:
            print(f"store CPU per chat on PostgreSQL ({args.chats} chats, {args.concurrency} at once): "
                  f"base {base}, this tree ({this}), this tree through the engine", flush=True)
            for r in range(args.rounds):
                result = {side: await measure(side, roots[side], args) for side in SIDES}
                rounds.append({side: {k: round(v, 3) for k, v in res.items()} for side, res in result.items()})
                print(f"  round {r + 1}: " + "   ".join(f"{side} {res['cpu_ms']:5.2f} ms cpu {res['wall_ms']:5.2f} ms "
                                                        f"wall" for side, res in result.items()), flush=True)
    medians = {side: {k: round(statistics.median(r[side][k] for r in rounds), 3) for k in ("cpu_ms", "wall_ms")}
               for side in SIDES}
    print("median per chat: " + ", ".join(f"{side} {m['cpu_ms']:.2f} ms cpu / {m['wall_ms']:.2f} ms wall"
                                           for side, m in medians.items()))
    report: dict[str, Any] = {
        "benchmark": "store_requests",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(),
        "base": base, "this": this, "chats": args.chats, "concurrency": args.concurrency,
        "sides": {"base": f"{base} as it is", "this": f"{this} as it is",
                  "engine": f"{this}, the chat path's statements through SQLAlchemy's engine"},
        "rounds": rounds, "median_per_chat": medians,
        "this_over_base_cpu": round(medians["this"]["cpu_ms"] / medians["base"]["cpu_ms"], 3),
        "this_over_engine_cpu": round(medians["this"]["cpu_ms"] / medians["engine"]["cpu_ms"], 3),
    }
    relay.RESULTS.mkdir(parents=True, exist_ok=True)
    (relay.RESULTS / "store_requests.json").write_text(json.dumps(report, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    parser = gateway_requests.comparison_parser(__doc__, this_arg=False)
    parser.add_argument("--chats", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--worker", metavar="DATABASE", help=argparse.SUPPRESS)  # one side's run, on this database
    parser.add_argument("--through-engine", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop  # as the gateway runs

    arguments = parse_args()
    if arguments.worker:
        print(json.dumps(uvloop.run(chats(arguments.worker, arguments, arguments.through_engine))))
    else:
        started = time.monotonic()
        uvloop.run(main(arguments))
        print(f"({time.monotonic() - started:.0f} s)")
