"""The vector index interface: entries (a key, a unit vector, its text and a little metadata) in
partitions, searched by cosine similarity within one partition at a time.

A partition is what one lookup may see: a user's memories, a conversation's file chunks. Searching
never crosses partitions, so one user's facts can never surface in another user's context.
Implementations: sql_index.py (SQLite and PostgreSQL, exact or pgvector HNSW).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The collections Fairway keeps; a partition's name is a user id or a conversation id.
MEMORIES = "memories"  # partition: user id; key: memory id
FILE_CHUNKS = "file_chunks"  # partition: file id; key: "<file id>:<chunk n>"
CONVERSATION_CHUNKS = "conversation_chunks"  # partition: conversation id; the attached files' chunks


@dataclass(frozen=True)
class Entry:
    key: str
    vector: np.ndarray  # float32, L2-normalised, the index's dim
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    key: str
    score: float  # cosine similarity, -1..1
    text: str
    meta: dict[str, Any]


@dataclass(frozen=True)
class Stored:
    """An entry read back by its key (its vector left in the index)."""

    key: str
    text: str
    meta: dict[str, Any]


class VectorIndex(ABC):
    dim: int
    kind: str  # "exact" or "pgvector": how search runs on this backend

    @abstractmethod
    async def init(self) -> None:
        """Create the tables (and, with pgvector, the HNSW index) if missing. Safe to call again."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def upsert(self, collection: str, partition: str, entries: Sequence[Entry]) -> None:
        """Add the entries, replacing any with the same key in the partition."""

    @abstractmethod
    async def delete(self, collection: str, partition: str, keys: Sequence[str]) -> int:
        """Remove these keys from the partition; how many were there."""

    @abstractmethod
    async def delete_partition(self, collection: str, partition: str) -> int: ...

    @abstractmethod
    async def copy_partition(self, collection: str, partition: str, to_collection: str, to_partition: str) -> int:
        """Copy every entry of one partition into another (replacing same keys), without
        re-embedding: a file's chunks into the conversation it is attached to."""

    @abstractmethod
    async def search(self, collection: str, partition: str, vector: np.ndarray, k: int,
                     min_score: float = -1.0) -> list[Hit]:
        """The partition's k entries most similar to vector (score >= min_score), best first."""

    @abstractmethod
    async def get(self, collection: str, partition: str, keys: Sequence[str]) -> list[Stored]:
        """These keys' entries in the partition, in the order of keys; a key not there is left out."""

    @abstractmethod
    async def count(self, collection: str, partition: str) -> int: ...


def as_unit_vector(vector: np.ndarray, dim: int) -> np.ndarray:
    """The vector as float32 of length dim; ValueError for a wrong shape or a zero vector."""
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape != (dim,):
        raise ValueError(f"expected a vector of {dim} values, got {v.shape[0]}")
    norm = float(np.linalg.norm(v))
    if not np.isfinite(norm) or norm == 0.0:
        raise ValueError("a vector must be finite and non-zero")
    return v / norm
