"""The vector index on its three backends (SQLite, PostgreSQL 15 without pgvector, PostgreSQL with
pgvector's HNSW index) against a brute-force answer, and the real embedding model."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.conversation import StoreUnavailable, database_url
from fairway.memory import MemoryStore
from fairway.retrieval import FILE_CHUNKS, MEMORIES, Entry, SqlVectorIndex

pytest_plugins = ["vector_backends"]  # its fixtures: the databases, the embedder

DIM = 384


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
async def open_index(vector_db):  # noqa: F811 - the imported fixture
    url, connect_args = vector_db
    opened: list[SqlVectorIndex] = []

    async def open_one() -> SqlVectorIndex:
        index = SqlVectorIndex(database_url(url), DIM, connect_args=connect_args)
        await index.init()
        opened.append(index)
        return index

    yield open_one
    for index in opened:
        await index.close()


async def test_search_matches_brute_force_within_the_partition(open_index, request):
    index = await open_index()
    expected_kind = "pgvector" if "pgvector" in request.node.name else "exact"
    assert index.kind == expected_kind
    rng = np.random.default_rng(7)
    mine, theirs = unit(rng, 300), unit(rng, 300)
    await index.upsert(MEMORIES, "alice", [Entry(f"a{i}", v, f"fact {i}", {"n": i}) for i, v in enumerate(mine)])
    await index.upsert(MEMORIES, "bob", [Entry(f"b{i}", v, f"bob {i}") for i, v in enumerate(theirs)])
    for q in unit(rng, 5):
        hits = await index.search(MEMORIES, "alice", q, k=5)
        best = np.argsort(-(mine @ q))[:5]
        assert [h.key for h in hits] == [f"a{i}" for i in best]
        assert [h.score for h in hits] == pytest.approx([float(mine[i] @ q) for i in best], abs=1e-4)
        assert hits[0].text == f"fact {best[0]}" and hits[0].meta == {"n": int(best[0])}
    # a query equal to one of bob's vectors still only finds alice's entries
    assert all(h.key.startswith("a") for h in await index.search(MEMORIES, "alice", theirs[0], k=10))
    assert await index.search(MEMORIES, "carol", mine[0], k=5) == []
    assert await index.count(MEMORIES, "alice") == 300


async def test_replace_delete_threshold_and_copy(open_index):
    index = await open_index()
    rng = np.random.default_rng(3)
    v = unit(rng, 4)
    await index.upsert(MEMORIES, "u", [Entry("m1", v[0], "old"), Entry("m2", v[1], "two")])
    await index.upsert(MEMORIES, "u", [Entry("m1", v[2], "new")])  # same key: replaced
    assert await index.count(MEMORIES, "u") == 2
    hit = (await index.search(MEMORIES, "u", v[2], k=1))[0]
    assert (hit.key, hit.text) == ("m1", "new") and hit.score == pytest.approx(1.0, abs=1e-4)
    assert [h.key for h in await index.search(MEMORIES, "u", v[2], k=5, min_score=0.9)] == ["m1"]
    got = await index.get(MEMORIES, "u", ["m2", "nope", "m1"])  # by key, in the keys' order
    assert [(g.key, g.text) for g in got] == [("m2", "two"), ("m1", "new")]
    assert await index.get(MEMORIES, "elsewhere", ["m1"]) == [] and await index.get(MEMORIES, "u", []) == []
    assert await index.delete(MEMORIES, "u", ["m1", "nope"]) == 1
    assert [h.key for h in await index.search(MEMORIES, "u", v[2], k=5)] == ["m2"]
    await index.upsert(FILE_CHUNKS, "file_1", [Entry("file_1:0", v[3], "chunk", {"page": 3})])
    assert await index.copy_partition(FILE_CHUNKS, "file_1", "conversation_chunks", "conv_1") == 1
    copied = await index.search("conversation_chunks", "conv_1", v[3], k=3)
    assert [(h.key, h.text, h.meta) for h in copied] == [("file_1:0", "chunk", {"page": 3})]
    assert await index.delete_partition(FILE_CHUNKS, "file_1") == 1
    assert await index.search(FILE_CHUNKS, "file_1", v[3], k=3) == []
    with pytest.raises(ValueError):
        await index.upsert(MEMORIES, "u", [Entry("bad", np.zeros(DIM, np.float32))])
    with pytest.raises(ValueError):
        await index.search(MEMORIES, "u", np.ones(3, np.float32), k=1)


async def test_another_process_sees_each_write(open_index):
    """Two indexes on one database (two gateways): a write through one is found by the other's
    next search, though the other cached the partition before the write."""
    a, b = await open_index(), await open_index()
    rng = np.random.default_rng(11)
    v = unit(rng, 3)
    await a.upsert(MEMORIES, "u", [Entry("m1", v[0])])
    assert [h.key for h in await b.search(MEMORIES, "u", v[1], k=5)] == ["m1"]
    await a.upsert(MEMORIES, "u", [Entry("m2", v[1])])
    assert (await b.search(MEMORIES, "u", v[1], k=1))[0].key == "m2"
    await a.delete(MEMORIES, "u", ["m2"])
    assert [h.key for h in await b.search(MEMORIES, "u", v[1], k=5)] == ["m1"]


def test_embedder_ranks_by_meaning_and_batches_consistently(embedder):
    facts = ["I'm allergic to peanuts", "My name is Ada", "I use Python for work", "I live in Lisbon"]
    vectors = embedder.embed(facts)
    assert vectors.shape == (4, 384) and vectors.dtype == np.float32
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(np.ones(4), abs=1e-5)
    questions = ["Suggest a snack with nuts", "What is my name?", "Which programming language should I use?"]
    for i, q in enumerate(embedder.embed(questions)):
        assert int(np.argmax(vectors @ q)) == i
    # one at a time (no padding) equals the padded batch
    single = np.vstack([embedder.embed([f]) for f in facts])
    assert single == pytest.approx(vectors, abs=1e-5)
    assert embedder.embed([]).shape == (0, 384)


async def test_a_database_that_does_not_answer_is_unavailable_not_a_crash():
    """Memory's, files' and the vector index's calls on a PostgreSQL that does not answer: on
    asyncpg's pool StoreUnavailable, as the conversation store's; through the engine the refused
    connection itself (a ConnectionError): both the gateway's 503 to retry (test_edge.py), not a 500."""
    url = database_url("postgresql://postgres@127.0.0.1:1/nowhere")
    index, memory = SqlVectorIndex(url, DIM), MemoryStore(url)
    try:
        with pytest.raises((StoreUnavailable, ConnectionError)):
            await index.count(MEMORIES, "u")  # the engine
        with pytest.raises((StoreUnavailable, ConnectionError)):
            await memory.list("u")  # the engine, memory's own
        with pytest.raises(StoreUnavailable):
            await memory.turn_state("u", "conv_x")  # the pool
    finally:
        await memory.close()
        await index.close()
