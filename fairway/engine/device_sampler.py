"""Sampling where the logits are (the GPU runner's): every row in one pass, the only wait for the
GPU being the copy of the sampled ids to the host.

The rows' settings (temperature, top-k, top-p) and their uniforms go up as one pinned upload each;
what to compute at all (any top-k, any top-p, all greedy) is decided from the host-side settings,
never by reading the device. Each sampled row draws one float64 uniform from its request's own
generator, as sampler.py does, against the same inverse CDF: a seed reproduces a reply whatever
shares its batch, and speculative verification (rejection_sampler.py) rewinds the same draws.
A temperature-only row is not the CPU's native sampler's draw, so a seeded reply may differ
between a CPU and a GPU replica.

A guided row's mask (guided_decoding.py) is computed on the host and uploaded: one pageable
copy per guided row, which waits for the step so far; only guided requests pay it. So do the
sparse penalties and logit bias of the rows that set them (logit_adjust.py): three small uploads.
Rows that ask for logprobs (logprobs.py) get them from the raw logits, a copy of their rows, and
wait for the step a second time (their values' copy to the host); the other rows pay nothing.
"""

from __future__ import annotations

import torch

from fairway.engine.host_buffers import HostBuffers
from fairway.engine.logprobs import attach, raw_logprobs
from fairway.engine.sampler import adjust_rows, draw, filtered, uniforms
from fairway.engine.sequence import Sequence


class DeviceSampler:
    def __init__(self, host: HostBuffers) -> None:
        self.host = host

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [S, V] float32 on the device, one row per sampled sequence (adjusted in place
        for those with penalties, a logit bias or a grammar). Returns the [S] token ids, on the device;
        a row asking for logprobs gets them from the logits as the model gave them (seq.step_logprobs)."""
        raw = raw_logprobs(logits, seqs)  # (before adjust_rows: vLLM's raw logprobs)
        tokens = self._sample(logits, seqs)
        attach(raw, tokens, seqs)
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        adjust_rows(logits, seqs)
        greedy_rows = [seq.params.greedy for seq in seqs]
        argmax = logits.argmax(dim=-1)
        if all(greedy_rows):
            return argmax
        vocab = logits.shape[-1]
        params = [seq.params for seq in seqs]
        up, stage = self.host.upload, self.host.stage
        temps = up(stage("temperature", [1.0 if g else p.temperature for g, p in zip(greedy_rows, params, strict=True)],
                         torch.float32))
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_k = up(stage("top_k", top_ks, torch.int64)) if any(k < vocab for k in top_ks) else None
        top_ps = [p.top_p for p in params]
        top_p = up(stage("top_p", top_ps, torch.float32)) if any(p < 1 for p in top_ps) else None
        # Greedy rows draw nothing (their generators are not touched), as on the CPU.
        draws = iter(uniforms([s.generator for s, g in zip(seqs, greedy_rows, strict=True) if not g]).tolist())
        u = up(stage("uniform", [0.0 if g else next(draws) for g in greedy_rows], torch.float64))
        drawn = draw(filtered(logits, temps, top_k, top_p).softmax(dim=-1), u)
        greedy = up(stage("greedy", greedy_rows, torch.bool))
        return torch.where(greedy, argmax, drawn)
