"""A file's opening chunks, in document order: what a turn that attaches files without a question
shows the model (there is nothing to retrieve for), so "here is my file" can be summarised. They
are the chunks processing stored in the vector index, read back by their keys ("<file id>:<n>"):
a search's order is the query's, not the document's."""

from __future__ import annotations

from dataclasses import dataclass

from fairway.retrieval import FILE_CHUNKS, VectorIndex


@dataclass(frozen=True)
class Chunk:
    n: int  # its place in the file, from 0
    text: str
    page: int | None


async def opening_chunks(index: VectorIndex, file_id: str, count: int) -> list[Chunk]:
    """The file's first `count` chunks (fewer if it has fewer), first to last."""
    stored = await index.get(FILE_CHUNKS, file_id, [f"{file_id}:{n}" for n in range(count)])
    return [Chunk(int(s.meta["chunk"]), s.text, s.meta.get("page")) for s in stored]
