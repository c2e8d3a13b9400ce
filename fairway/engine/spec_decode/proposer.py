"""What every proposer offers: up to k draft tokens per sequence, and what one draft token costs."""

from __future__ import annotations

from typing import Protocol

from fairway.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """At most ks[i] tokens likely to follow seqs[i] (decoding sequences: every token but the
        last has its K/V in the cache). Fewer, or none, where it has no good guess."""
        ...

    @property
    def seconds_per_token(self) -> float:
        """Time spent proposing one more draft token for the batch (0 for a lookup)."""
        ...
