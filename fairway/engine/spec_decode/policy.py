"""How many draft tokens each decoding sequence gets this step: as many as pay for themselves.

The k-th draft token adds a token only if it and every draft before it are accepted: with an
acceptance rate a (tracked per sequence and cue, state.py), with chance a^k. It costs one more
row of the verification step (and, for a draft model, one more draft step), while the batch
makes R tokens per second: worth it when a^k * (1 / cost) > R, that is a^k > cost * R. A single
stream on a CPU is bound by reading the weights, so an extra row costs a small share of a step
(bench/README.md, spec_decode.py) and drafts with a fair chance pay; a large batch
is compute-bound (a row costs about its share of the step) and only near-certain drafts would:
there speculation is off. A cue whose first draft no longer pays for a sequence is paused and
probed with one draft token now and then, as a reply's character changes (a quote ends, another
begins).
"""

from __future__ import annotations

from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.engine.step_time import PRIOR, StepTimeModel


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, step_time: StepTimeModel, max_model_len: int) -> None:
        self.config = config
        self.step_time = step_time
        self.max_model_len = max_model_len

    def threshold(self, num_decoding: int, prefill_tokens: int, seconds_per_draft: float) -> float:
        """The acceptance chance below which one more draft row costs more than it brings."""
        cost = self.step_time.cost
        step = cost.predict(num_decoding, prefill_tokens)
        if step <= 0:  # every term of the fit clamped to 0 (noise): it knows nothing, the prior does
            cost, step = PRIOR, PRIOR.predict(num_decoding, prefill_tokens)
        return (cost.per_decode_row + seconds_per_draft) * num_decoding / step

    def drafts_at(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding sequences may give any of them drafts."""
        return 0 < num_decoding < self.config.disable_by_batch_size

    def plan(self, seqs: list[Sequence], step: int, prefill_tokens: int, seconds_per_draft: float,
             cues: list[int | None] | None = None) -> list[int]:
        """Draft tokens for each decoding sequence (0: none this step). cues: what each one's guess
        would rest on (the proposer's cue; None: no guess), priced by that cue's record."""
        if not self.drafts_at(len(seqs)):
            return [0] * len(seqs)
        theta = self.threshold(len(seqs), prefill_tokens, seconds_per_draft)
        return [self._for(seq, step, theta, 0 if cues is None else cues[i]) for i, seq in enumerate(seqs)]

    def _for(self, seq: Sequence, step: int, theta: float, cue: int | None) -> int:
        # Room to emit k + 1 tokens within max_tokens and the context window.
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        limit = min(self.config.num_speculative_tokens, room)
        if limit <= 0 or cue is None:
            return 0
        record = seq.spec.acceptance(cue)
        if step < record.paused_until:
            return 0
        k = 0
        while k < limit and record.rate ** (k + 1) >= theta:
            k += 1
        if k == 0:  # not worth it now: pause, then probe with one draft token
            record.paused_until = step + self.config.pause_steps
            return 1 if record.num_drafts else 0
        return k
