"""Exact cosine search over one partition in numpy, and the per-process cache of partitions'
matrices that makes it cheap: a partition is read from the database once per change, not per
lookup (its version, bumped by every write in the same transaction, says when)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PartitionMatrix:
    version: int
    keys: list[str]
    matrix: np.ndarray  # (n, dim) float32, unit rows

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes


def top_k(matrix: np.ndarray, vector: np.ndarray, k: int, min_score: float) -> list[tuple[int, float]]:
    """Rows of matrix most similar to vector (both unit length): (row, score), best first."""
    if k <= 0 or matrix.shape[0] == 0:
        return []
    scores = matrix @ vector
    k = min(k, scores.shape[0])
    best = np.argpartition(-scores, k - 1)[:k]
    best = best[np.argsort(-scores[best], kind="stable")]
    return [(int(i), float(scores[i])) for i in best if scores[i] >= min_score]


class PartitionCache:
    """Partitions' matrices by (collection, partition), least recently used out first once the
    total passes max_bytes."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], PartitionMatrix] = OrderedDict()
        self._bytes = 0

    def get(self, collection: str, partition: str, version: int) -> PartitionMatrix | None:
        item = self._items.get((collection, partition))
        if item is None or item.version != version:
            return None
        self._items.move_to_end((collection, partition))
        return item

    def put(self, collection: str, partition: str, item: PartitionMatrix) -> None:
        self.drop(collection, partition)
        if item.nbytes > self.max_bytes:
            return
        self._items[(collection, partition)] = item
        self._bytes += item.nbytes
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes

    def drop(self, collection: str, partition: str) -> None:
        old = self._items.pop((collection, partition), None)
        if old is not None:
            self._bytes -= old.nbytes
