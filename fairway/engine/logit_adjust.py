"""OpenAI's presence and frequency penalties and logit bias, as one sequence's additions to its
logits before sampling (the greedy rows' argmax included).

For each token t the sequence has generated count[t] times (its completion's tokens, not the
prompt's): logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0); and
logit[t] += logit_bias[t]. The counts are kept as tokens are appended, never recounted, and a
sequence that sets none of these has no LogitAdjust at all: the sampler spends nothing on it.
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
        """A token the sequence generated."""
        if self.penalised:  # a bias alone needs no counts
            self.counts[token] += 1

    def deltas(self) -> dict[int, float]:
        """What to add to each token's logit, each token once (its bias and penalty summed here)."""
        out = dict(self.logit_bias)
        for token, count in self.counts.items():
            out[token] = out.get(token, 0.0) - (self.frequency_penalty * count + self.presence_penalty)
        return out


def adjust_logits(logits: torch.Tensor, rows: list[int], adjusts: list[LogitAdjust]) -> None:
    """Each listed row's logits, in place, plus its sequence's deltas: one scatter where the logits
    are (on a GPU: three small uploads of the sparse deltas, made by the rows that have any)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, adjust in zip(rows, adjusts, strict=True):
        deltas = adjust.deltas()
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
