"""A file's opening chunks, in document order: what a turn that attaches files without a question
shows the model (there is nothing to retrieve for), so "here is my file" can be summarised.

The chunks are the ones processing stored in the vector index's table, read back by their keys
("<file id>:<n>"); the index's interface offers only similarity search, whose order is not the
document's."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fairway.retrieval import FILE_CHUNKS
from fairway.retrieval.sql_index import Json

# The columns of the index's table (migration 0006) this reads; the embedding is not needed.
_vectors = sa.table("vectors", sa.column("collection"), sa.column("partition"), sa.column("key"),
                    sa.column("text"), sa.column("meta", Json))


@dataclass(frozen=True)
class Chunk:
    n: int  # its place in the file, from 0
    text: str
    page: int | None


async def opening_chunks(engine: AsyncEngine, file_id: str, count: int) -> list[Chunk]:
    """The file's first `count` chunks (fewer if it has fewer), first to last."""
    keys = [f"{file_id}:{n}" for n in range(count)]
    if not keys:
        return []
    v = _vectors.c
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(v.text, v.meta).where(
            v.collection == FILE_CHUNKS, v.partition == file_id, v.key.in_(keys)))).all()
    chunks = [Chunk(int(r.meta["chunk"]), r.text, r.meta.get("page")) for r in rows]
    return sorted(chunks, key=lambda c: c.n)
