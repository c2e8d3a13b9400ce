"""Embeddings and the vector index that memory and files both use."""

from __future__ import annotations

from .embedder import Embedder, EmbedderUnavailable, MiniLMEmbedder, embedder_available, shared_embedder
from .index import CONVERSATION_CHUNKS, FILE_CHUNKS, MEMORIES, Entry, Hit, Stored, VectorIndex
from .sql_index import SqlVectorIndex

__all__ = [
    "CONVERSATION_CHUNKS",
    "FILE_CHUNKS",
    "MEMORIES",
    "Embedder",
    "EmbedderUnavailable",
    "Entry",
    "Hit",
    "MiniLMEmbedder",
    "SqlVectorIndex",
    "Stored",
    "VectorIndex",
    "embedder_available",
    "make_index",
    "shared_embedder",
]


def make_index(url: str | None = None, **options) -> VectorIndex:  # noqa: ANN003 - SqlVectorIndex's
    """The index in the conversation store's database (`url` as for make_store; None: the
    embedded SQLite file). Call `await index.init()` first."""
    from fairway.conversation import database_url

    return SqlVectorIndex(database_url(url), **options)
