"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n
tokens, for the longest n that has one. It needs no second model and pays off where the reply
quotes its input (summaries, edits, answers citing a document, code changes).

Each sequence keeps an index from every n-gram of its tokens to where it last ended, updated with
the tokens added since the previous proposal, so a proposal costs a few dictionary lookups
rather than a scan of the whole context. The match's length is the proposal's cue (proposer.py):
after a one-token match the guess is right far less often than after a long one.
"""

from __future__ import annotations

from fairway.engine.sequence import Sequence

# Match lengths from this one on share a cue: longer matches are accepted about as often.
LONG_MATCH = 4


class NgramProposer:
    seconds_per_token = 0.0

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def cue(self, seq: Sequence) -> int | None:
        """The length of the n-gram the guess would follow (LONG_MATCH and longer alike), None
        without a match."""
        match = self._match(seq)
        return None if match is None else min(match[0], LONG_MATCH)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self._propose(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        match = self._match(seq)
        if match is None:
            return []
        n, end = match  # a longer match is a surer guess: at most n + 2 tokens from it
        return seq.token_ids[end + 1:end + 1 + min(k, n + 2)]

    def _match(self, seq: Sequence) -> tuple[int, int] | None:
        """The longest n whose last n tokens occurred earlier, and where that occurrence ended."""
        tokens, state = seq.token_ids, seq.spec
        last = len(tokens) - 1
        index = state.ngram_index
        # n-grams ending before the last token: the suffix must match somewhere earlier, not itself.
        for end in range(state.ngram_indexed, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index[tuple(tokens[end + 1 - n:end + 1])] = end
        state.ngram_indexed = max(state.ngram_indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = index.get(tuple(tokens[last + 1 - n:]))
            if end is not None:
                return n, end
        return None
