"""How long a step takes, as measured: a fixed cost, a cost per decode row, a cost per prefill token,
and how a step's draft rows grow dearer the more of them it has.

Fit online by exponentially weighted least squares over the engine's own steps, with a weak prior
that holds the split between terms the recent steps cannot tell apart (a single stream always
decoding one row says nothing about the cost of a second row). Speculative decoding asks it what
each further draft row costs; the scheduler asks it how many prefill tokens fit in a step's time
target.

Why the draft term: a step of few rows is bound by reading the weights, and its first extra rows
ride along; past some count each row pays its own products (where a CPU multiplies slowly, a
verification of 5-9 rows costs 2-4x a one-row step, bench/README.md, spec_decode.py). A cost linear
in the rows averages those and over-drafts; a term in the square of the step's draft rows lets
the fit bend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    fixed: float  # seconds per step
    per_decode_row: float  # seconds per decode row (a sequence's new token, or one of its draft tokens)
    per_prefill_token: float
    per_draft_row_squared: float = 0.0  # seconds per squared draft row of the step (its drafts' growth)

    def predict(self, decode_rows: int, prefill_tokens: int, draft_rows: int = 0) -> float:
        """decode_rows counts the draft rows among them (each a row like any other), draft_rows
        says how many there are."""
        return (self.fixed + self.per_decode_row * decode_rows + self.per_prefill_token * prefill_tokens
                + self.per_draft_row_squared * draft_rows * draft_rows)

    def draft_row(self, d: int) -> float:
        """What the d-th draft row of a step adds to it (d >= 1)."""
        return self.per_decode_row + self.per_draft_row_squared * (2 * d - 1)


# The prior: what the bundled 135M model costs in bf16 on 2 AVX512-BF16 cores, in seconds. Any
# machine's own steps outweigh it within a few dozen steps wherever the batch varies.
PRIOR = StepCost(fixed=0.012, per_decode_row=0.0006, per_prefill_token=0.0003)
# The prior counts as this many steps of each kind (a decode row, a 64-token prefill, 4 draft rows):
# a fraction of one, so that what the steps do show is theirs. At 2 steps its price of a prompt
# token held against the few prompt steps in memory, their cost went into the fixed term, and the
# fit over-predicted decode steps (+14% for one stream) and under-priced later draft rows; the
# scheduler's step bound then let steps run long (bench/README.md, itl.py) ...
PRIOR_WEIGHT = 0.2
# ... and each measured step's weight decays by this much per step (~100 steps remembered).
DECAY = 0.99


class StepTimeModel:
    def __init__(self, prior: StepCost = PRIOR) -> None:
        mean = np.array([prior.fixed, prior.per_decode_row, prior.per_prefill_token, prior.per_draft_row_squared])
        # Ridge precision of the prior, scaled to typical feature sizes so each term's prior weighs
        # about PRIOR_WEIGHT steps: rows ~ 8, prefill tokens ~ 64, squared draft rows ~ 16.
        self._prior_precision = PRIOR_WEIGHT * np.diag([1.0, 8.0 ** 2, 64.0 ** 2, 16.0 ** 2])
        self._prior_moment = self._prior_precision @ mean
        self._xx = np.zeros((4, 4))  # decayed sums of x x^T and x y over measured steps
        self._xy = np.zeros(4)
        self.cost = prior
        self.num_observed = 0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float, draft_rows: int = 0) -> None:
        """A step's time; decode_rows counts its draft_rows among them."""
        x = np.array([1.0, decode_rows, prefill_tokens, draft_rows * draft_rows])
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * seconds
        self.num_observed += 1
        coef = np.linalg.solve(self._xx + self._prior_precision, self._xy + self._prior_moment)
        coef = np.maximum(coef, 0.0)  # a negative cost is noise, never a saving
        self.cost = StepCost(*(float(c) for c in coef))

    def predict(self, decode_rows: int, prefill_tokens: int, draft_rows: int = 0) -> float:
        return self.cost.predict(decode_rows, prefill_tokens, draft_rows)
