"""Streams a sequence's text deltas and ends it at a stop string, never emitting the stop string itself.

Text that might be the start of a stop string is held back until the next token decides it.
"""

from __future__ import annotations

from fairway.engine.sampling_params import SamplingParams


class StopChecker:
    def __init__(self, params: SamplingParams, tokenizer=None) -> None:
        self.stops = list(params.stop)
        self.detok = None
        if tokenizer is not None:
            from fairway.models.detokenizer import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer)
        self.pending = ""  # decoded but not yet emitted

    def add(self, token: int, is_stop_token: bool = False) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string was reached)."""
        if self.detok is None or is_stop_token:
            return "", False  # a stop token's own text (e.g. <|im_end|>) is never shown
        self.pending += self.detok.add(token)
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = self._held_back()
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        """At the end: whatever was held back, plus any bytes the detokenizer still had."""
        out = self.pending + (self.detok.flush() if self.detok is not None else "")
        self.pending = ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:k]):
                    best = k
                    break
        return best
