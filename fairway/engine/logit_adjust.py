"""OpenAI's presence and frequency penalties and logit bias, as one sequence's additions to its
logits before sampling (the greedy rows' argmax included).

For each token t the sequence has generated count[t] times (its completion's tokens, not the
prompt's): logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0); and
logit[t] += logit_bias[t]. The counts, and each token's sum, are kept as tokens are appended,
never recounted; a sequence that sets none of these has no LogitAdjust: the sampler spends
nothing on it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from fairway.engine.sampling_params import SamplingParams


@dataclass
class LogitAdjust:
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    counts: Counter[int] = field(default_factory=Counter)  # generated tokens, when a penalty is set
    # What to add to each token's logit, each token once: its bias and penalty, kept with the counts.
    deltas: dict[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.deltas = dict(self.logit_bias)

    @classmethod
    def of(cls, params: SamplingParams, output_token_ids: list[int]) -> LogitAdjust | None:
        """The adjustment of a sequence that has generated these tokens; None when it has none."""
        if not params.adjusts_logits:
            return None
        adjust = cls(params.presence_penalty, params.frequency_penalty, params.logit_bias)
        for token in output_token_ids:
            adjust.add(token)
        return adjust

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def add(self, token: int) -> None:
        """A token the sequence generated: one more frequency penalty on it, the presence penalty
        the first time."""
        if not self.penalised:  # a bias alone needs no counts
            return
        count = self.counts[token]
        self.counts[token] = count + 1
        self.deltas[token] = (self.deltas.get(token, 0.0) - self.frequency_penalty
                              - (0.0 if count else self.presence_penalty))


def adjust_logits(logits: torch.Tensor, rows: list[int], adjusts: list[LogitAdjust]) -> None:
    """Each listed row's logits, in place, plus its sequence's deltas: one scatter where the logits
    are (on a GPU: three small uploads of the sparse deltas, made by the rows that have any)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, adjust in zip(rows, adjusts, strict=True):
        deltas = adjust.deltas
        row_ids += [row] * len(deltas)
        token_ids += deltas.keys()
        values += deltas.values()
    if not values:
        return
    dev = logits.device
    with torch.inference_mode():  # the model's logits are inference tensors: updated in place here only
        index = (torch.tensor(row_ids, device=dev), torch.tensor(token_ids, device=dev))
        logits.index_put_(index, torch.tensor(values, dtype=torch.float64).to(logits.dtype).to(dev),
                          accumulate=True)
