"""Samples every row of a step and keeps, for a sequence with draft tokens, the longest run of them
that the target model itself would have produced.

A sequence verifying d draft tokens brings d + 1 rows of logits: row i is the target's
distribution p_i for the token after its i-th scheduled token. Each row is sampled exactly as
without speculation (sampler.sample: argmax, or one uniform from the request's generator against
p_i). Draft i is accepted when it equals the token sampled from row i - 1; the first row whose
sample differs gives the token emitted in the draft's place, and when every draft is accepted the
last row gives one more (the bonus token).

This is rejection sampling for deterministic proposals (both proposers propose their single most
likely continuation, q = one-hot on the draft x): accept x with probability min(1, p(x) / q(x)) =
p(x), else draw from norm(max(p - q, 0)) = p without x. Drawing t ~ p and accepting when t == x
does both at once, so every emitted token is distributed exactly as p_i. Moreover, the seeded
draws of row i are the ones the request would have used at that position without speculation,
and the generator is wound back past the draws of rows whose token was not emitted: a seeded
reply is the same with speculation on or off, and greedy is token for token the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fairway.engine.sampler import sample
from fairway.engine.sequence import Sequence


def sample_and_verify(logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int],
                      sampler: Callable[[torch.Tensor, list[Sequence]], list[int]] = sample) -> list[list[int]]:
    """logits: [sum(num_rows), V], each sequence's rows consecutive (num_rows[i] - 1 of its
    spec_token_ids are checked). Returns the tokens each sequence emits: 1 .. num_rows[i].
    sampler: the rows' tokens (sampler.sample on the host; the GPU runner's samples on the device)."""
    rows = [seq for seq, n in zip(seqs, num_rows, strict=True) for _ in range(n)]
    rewind = [_state(seq) if n > 1 else None for seq, n in zip(seqs, num_rows, strict=True)]
    sampled = sampler(logits, rows)
    out: list[list[int]] = []
    row = 0
    for seq, n, state in zip(seqs, num_rows, rewind, strict=True):
        target = sampled[row:row + n]
        row += n
        kept = 0
        while kept < n - 1 and seq.spec_token_ids[kept] == target[kept]:
            kept += 1
        out.append(target[:kept + 1])
        if state is not None and kept + 1 < n:
            _replay(seq.generator, state, kept + 1)
    return out


def _state(seq: Sequence) -> torch.Tensor | None:
    """The generator's state before the step's draws, when the sequence draws from its own one."""
    if seq.generator is None or seq.params.greedy:
        return None
    return seq.generator.get_state()


def _replay(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Leave the generator as if only the first `draws` uniforms of this step had been taken (the
    sampler takes one float64 uniform per row)."""
    generator.set_state(state)
    for _ in range(draws):
        torch.rand(1, generator=generator, dtype=torch.float64)
