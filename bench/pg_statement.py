"""One PostgreSQL statement's CPU on the gateway's side, three ways, in one run.

The floor under every store call of a chat request (conversation/hot_path.py): the same small
`SELECT` with one parameter, run one after another on

* a connection the caller holds (asyncpg's `Connection.fetch`: no pool at all);
* the store's hot path (`PostgresHotPath.fetch`: asyncpg's own pool, configured as the store
  runs it, the statement compiled once by SQLAlchemy);
* the hot path inside `one_connection()`, four statements a checkout (the recorder's batches);
* asyncpg's pool with its defaults (a reset query at every release).

The figure is this process's CPU per statement (`time.process_time`; PostgreSQL's own CPU is not
in it) and the wall time, each the median of `--rounds` rounds of `--statements` statements, the
three taking turns round after round. Results: bench/results/pg_statement.json.

    .venv/bin/python bench/pg_statement.py                       # the local PostgreSQL's `test` database
    .venv/bin/python bench/pg_statement.py --database postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SQL = "SELECT 1 AS x WHERE $1::integer > 0"


async def per_statement(run: Callable[[], Awaitable[Any]], statements: int, per_run: int = 1) -> tuple[float, float]:
    """(CPU us, wall us) per statement over statements statements (per_run a run), after a warm-up."""
    for _ in range(200 // per_run):
        await run()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(statements // per_run):
        await run()
    done = statements // per_run * per_run
    return ((time.process_time() - cpu) / done * 1e6, (time.perf_counter() - wall) / done * 1e6)


async def main(args: argparse.Namespace) -> None:
    import asyncpg
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from fairway.conversation.hot_path import PostgresHotPath

    engine = create_async_engine(args.database.replace("postgresql://", "postgresql+asyncpg://", 1))
    hot = PostgresHotPath.of_engine(engine)
    statement = sa.select(sa.literal_column("1").label("x")).where(sa.bindparam("a", type_=sa.Integer) > 0)
    held = await asyncpg.connect(args.database)
    pool = await asyncpg.create_pool(args.database, min_size=1, max_size=4)

    async def through_default_pool() -> Any:
        async with pool.acquire() as conn:
            return await conn.fetch(SQL, 1)

    async def four_a_checkout() -> None:
        async with hot.one_connection():
            for _ in range(4):
                await hot.fetch(statement, {"a": 1})

    sides: dict[str, tuple[Callable[[], Awaitable[Any]], int]] = {
        "held connection": (lambda: held.fetch(SQL, 1), 1),
        "store hot path (asyncpg pool)": (lambda: hot.fetch(statement, {"a": 1}), 1),
        "hot path, 4 a checkout": (four_a_checkout, 4),
        "asyncpg pool, defaults": (through_default_pool, 1),
    }
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    try:
        for _ in range(args.rounds):
            for name, (run, per_run) in sides.items():
                rounds[name].append(await per_statement(run, args.statements, per_run))
    finally:
        await held.close()
        await pool.close()
        await hot.close()
        await engine.dispose()
    medians = {name: {"cpu_us": round(statistics.median(c for c, _ in r), 1),
                      "wall_us": round(statistics.median(w for _, w in r), 1)} for name, r in rounds.items()}
    floor = medians["held connection"]["cpu_us"]
    print(f"one statement, {args.statements} in a row, median of {args.rounds} rounds")
    print(f"  {'':32s} {'CPU us':>8s} {'wall us':>8s} {'CPU / held':>10s}")
    for name, m in medians.items():
        print(f"  {name:32s} {m['cpu_us']:8.1f} {m['wall_us']:8.1f} {m['cpu_us'] / floor:9.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pg_statement.json").write_text(json.dumps({
        "benchmark": "pg_statement", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(), "statements": args.statements, "rounds_run": args.rounds,
        "medians": medians, "rounds": {name: [list(r) for r in rs] for name, rs in rounds.items()},
    }, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop  # as the gateway runs

    uvloop.run(main(parse_args()))
