"""Turns the last-position logits of each sequence into its next token.

Penalties, logit bias and a grammar's mask apply first, to the rows that set them (adjust_rows);
the rows that ask for logprobs have theirs taken before that, from the raw logits (logprobs.py).
Three kinds of row: greedy (argmax), temperature only (the native one-pass sampler on the CPU,
where it is built), and filtered by top-k or top-p (PyTorch: a sort). Every sampled row draws one
uniform from its request's own generator, so a seed reproduces a reply whatever shares its batch.
"""

from __future__ import annotations

import torch

from fairway.engine.guided_decoding import mask_logits
from fairway.engine.logit_adjust import adjust_logits
from fairway.engine.logprobs import attach, raw_logprobs
from fairway.engine.sequence import Sequence
from fairway.models.cpu_kernels import temperature_sampler


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [S, V] float32, one row per sequence that samples this step. A row with penalties or
    a logit bias, or guided, is adjusted first (in place: adjust_rows); the others are not touched.
    A row asking for logprobs gets them from the logits as the model gave them (seq.step_logprobs)."""
    raw = raw_logprobs(logits, seqs)  # (before adjust_rows: vLLM's raw logprobs)
    adjust_rows(logits, seqs)
    out = [0] * len(seqs)
    greedy, plain, filtered = _kinds(seqs, logits.shape[-1], logits.device.type == "cpu")
    for rows, pick in ((greedy, _argmax), (plain, _sample_native), (filtered, _sample_filtered)):
        if rows:
            # All rows of one kind (the usual batch) need no gathered copy of the logits.
            chosen = logits if len(rows) == len(seqs) else logits[torch.tensor(rows)]
            tokens = pick(chosen, [seqs[i] for i in rows])
            for i, token in zip(rows, tokens.tolist(), strict=True):
                out[i] = token
    attach(raw, out, seqs)
    return out


def adjust_rows(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """The rows' logits as they are sampled, every kind of row alike (greedy rows take the argmax of
    these): plus the penalties and logit bias of the rows that set them (logit_adjust.py), then
    -inf where a guided row's grammar refuses the token. The mask comes last, so no bias brings back
    a token the grammar refuses. Shared with the GPU's sampler (device_sampler.py)."""
    adjusted = [i for i, seq in enumerate(seqs) if seq.adjust is not None]
    if adjusted:
        adjust_logits(logits, adjusted, [seqs[i].adjust for i in adjusted])
    guided = [i for i, seq in enumerate(seqs) if seq.guide is not None]
    if guided:
        mask_logits(logits, guided, [seqs[i].guide for i in guided])


def _kinds(seqs: list[Sequence], vocab: int, cpu: bool) -> tuple[list[int], list[int], list[int]]:
    greedy: list[int] = []
    plain: list[int] = []
    filtered: list[int] = []
    native = cpu and temperature_sampler() is not None
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            greedy.append(i)
        elif native and p.top_p >= 1 and not 0 < p.top_k < vocab:
            plain.append(i)
        else:
            filtered.append(i)
    return greedy, plain, filtered


def _argmax(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    # On the CPU NumPy's argmax (vectorized, the first maximum as torch's) takes a fifth of
    # torch's time over a full batch's [rows, vocab] (bench/README.md, "Greedy argmax").
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _sample_native(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    return temperature_sampler()(logits.contiguous(), temps, uniforms([s.generator for s in seqs]))


def _sample_filtered(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return _draw(_filtered_probs(logits, seqs), [s.generator for s in seqs])


def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_ks = [s.params.top_k for s in seqs]
    top_ps = [s.params.top_p for s in seqs]
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]) if any(top_ks) else None
    top_p = torch.tensor(top_ps, dtype=logits.dtype) if any(p < 1 for p in top_ps) else None
    return filtered(logits, temps, top_k, top_p).softmax(dim=-1)


def filtered(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
             top_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's logits over its temperature, what its top-k and top-p leave out at -inf. The
    rows' settings are tensors where the logits are (None: no row filters by it), so a caller on
    a GPU decides what to compute from the settings it holds, never by reading the device."""
    logits = logits / temperatures[:, None]
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    return draw(probs, uniforms(generators))


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: a single uniform per row (float64, where probs are), from
    that request's own generator (so a seed reproduces its reply whatever else is in the batch),
    against one batched cumulative sum. A noise value per vocabulary entry per row instead (49k
    draws a row) cost more than all the rest of sampling. The sum runs in float64 so tokens of tiny
    probability keep their share."""
    cdf = probs.double().cumsum(dim=-1)
    u = uniform * cdf[:, -1]
    # right=True: the first entry whose cumulative mass exceeds u, never a zero-probability token.
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from its own generator (None: the global one)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
