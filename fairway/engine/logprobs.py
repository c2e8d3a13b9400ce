"""OpenAI's logprobs: for the rows of a step that ask, the log-probability of the sampled token and
of the k most likely tokens, from the model's raw logits.

Raw as vLLM's default (logprobs_mode "raw_logprobs"): the log-softmax of the logits before the
penalties, the logit bias, a grammar's mask and the temperature, so a reply's logprobs say what the
model thinks of each token, whatever the request did to its sampling. The rows that do not ask
cost nothing: no copy, no softmax (a step with none of them returns at the first check).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fairway.engine.outputs import Logprobs
from fairway.engine.sequence import Sequence


@dataclass
class RawLogprobs:
    """The log-softmax of the asking rows, taken before the step's adjustments change the logits
    (tensors where the logits are: read back with the sampled tokens, so a GPU waits once)."""

    rows: list[int]  # their rows among the step's
    logprobs: torch.Tensor  # [len(rows), V] float32
    top_values: torch.Tensor | None  # [len(rows), k], best first (None: no row wants top tokens)
    top_ids: torch.Tensor | None


def raw_logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> RawLogprobs | None:
    """Before the sampler adjusts the logits in place: the asking rows' log-softmax (a copy) and
    their top tokens; None when no row of the step asks."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return None
    logprobs = logits[torch.tensor(rows, device=logits.device)].float().log_softmax(dim=-1)
    k = max(seqs[i].params.logprobs or 0 for i in rows)
    values, ids = logprobs.topk(k, dim=-1) if k else (None, None)  # sorted, best first
    return RawLogprobs(rows, logprobs, values, ids)


def attach(raw: RawLogprobs | None, tokens: list[int] | torch.Tensor, seqs: list[Sequence]) -> None:
    """Once the step's tokens are sampled: each asking row's sequence gets its token's Logprobs
    (seq.step_logprobs, taken by the engine with the token). tokens: the step's, a list or a
    tensor where the logits are."""
    if raw is None:
        return
    device = raw.logprobs.device
    index = torch.tensor(raw.rows, device=device)
    chosen = tokens[index] if isinstance(tokens, torch.Tensor) else torch.tensor([tokens[i] for i in raw.rows])
    chosen = chosen.to(device=device, dtype=torch.long)
    values = raw.logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top_values = raw.top_values.tolist() if raw.top_values is not None else [[] for _ in raw.rows]
    top_ids = raw.top_ids.tolist() if raw.top_ids is not None else [[] for _ in raw.rows]
    for j, (row, token) in enumerate(zip(raw.rows, chosen.tolist(), strict=True)):
        wanted = seqs[row].params.logprobs or 0
        seqs[row].step_logprobs = Logprobs(token, values[j], list(zip(top_ids[j][:wanted], top_values[j][:wanted],
                                                                         strict=True)))
