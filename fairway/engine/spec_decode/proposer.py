"""What every proposer offers: up to k draft tokens per sequence, what one draft token costs, and
the cue its next guess for a sequence would rest on."""

from __future__ import annotations

from typing import Protocol

from fairway.engine.sequence import Sequence


class Proposer(Protocol):
    def cue(self, seq: Sequence) -> int | None:
        """What the next guess for seq rests on, as a small integer whose drafts are priced on their
        own acceptance record (policy.py), or None when there is no guess to make."""
        ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """At most ks[i] tokens likely to follow seqs[i] (decoding sequences: every token but the
        last has its K/V in the cache). Fewer, or none, where it has no good guess."""
        ...

    @property
    def seconds_per_token(self) -> float:
        """Time spent proposing one more draft token for the batch (0 for a lookup)."""
        ...
