"""Turns the last-position logits of each sequence into its next token."""

from __future__ import annotations

import torch

from fairway.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [S, V] float32, one row per sequence that samples this step."""
    if all(s.params.greedy for s in seqs):
        return logits.argmax(dim=-1).tolist()
    out = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    idx = torch.tensor(rows)
    probs = _filtered_probs(logits[idx], [seqs[i] for i in rows])
    for j, i in enumerate(rows):
        out[i] = _draw(probs[j], seqs[i].generator)
    return out.tolist()


def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [s.params.top_k for s in seqs]
    if any(top_ks):
        vocab = logits.shape[-1]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
    if (top_ps < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
        drop = (cum - sorted_logits.softmax(dim=-1)) >= top_ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and seeds per request cleanly.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
