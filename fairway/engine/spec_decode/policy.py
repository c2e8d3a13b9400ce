"""How many draft tokens each decoding sequence gets this step: as many as raise the step's tokens
per second.

The k-th draft token of a sequence adds a token only if it and every draft before it are accepted:
with an acceptance rate a (tracked per sequence and cue, state.py), with chance a^k. It costs one
more row of the verification step (and, for a draft model, one more draft step): the step-time
model's price of the step's d-th draft row, which grows with d where extra rows are dear
(step_time.py). Drafts are taken surest first, across the batch, while each one's chance over its
cost beats the tokens per second of the step as planned so far: the step's expected tokens over
its time then only rises, and stops where it is highest. A single stream on a CPU is bound by
reading the weights, so its first extra rows cost a small share of a step and drafts with a fair
chance pay; a large batch is compute-bound (a row costs about its share of the step) and only
near-certain drafts would: there speculation is off. A cue whose first draft does not pay for a
sequence is paused and probed with one draft token now and then, as a reply's character changes
(a quote ends, another begins).
"""

from __future__ import annotations

import heapq

from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.engine.spec_decode.state import Acceptance
from fairway.engine.step_time import PRIOR, StepCost, StepTimeModel


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, step_time: StepTimeModel, max_model_len: int) -> None:
        self.config = config
        self.step_time = step_time
        self.max_model_len = max_model_len

    def drafts_at(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding sequences may give any of them drafts."""
        return 0 < num_decoding < self.config.disable_by_batch_size

    @staticmethod
    def draft_pays(chance: float, seconds: float, tokens: float, step_seconds: float) -> bool:
        """Whether a draft accepted with this chance, costing these seconds, raises the tokens per
        second of a step planned so far at tokens in step_seconds."""
        return chance * step_seconds >= seconds * tokens

    def plan(self, seqs: list[Sequence], step: int, prefill_tokens: int, seconds_per_draft: float,
             cues: list[int | None] | None = None) -> list[int]:
        """Draft tokens for each decoding sequence (0: none this step). cues: what each one's guess
        would rest on (the proposer's cue; None: no guess), priced by that cue's record."""
        if not self.drafts_at(len(seqs)):
            return [0] * len(seqs)
        cost, step_seconds = self._cost(len(seqs), prefill_tokens)
        # The sequences that may get drafts this step: each one's acceptance record and room.
        open_to: dict[int, tuple[Acceptance, int]] = {}
        for i, seq in enumerate(seqs):
            record = self._record(seq, step, 0 if cues is None else cues[i])
            if record is not None and (room := self._room(seq)) > 0:
                open_to[i] = (record, room)
        surest = [(-record.rate, i) for i, (record, _) in open_to.items()]  # (-chance of i's next draft, i)
        heapq.heapify(surest)
        ks = [0] * len(seqs)
        tokens, drafts = float(len(seqs)), 0
        while surest:
            chance, i = -surest[0][0], surest[0][1]
            extra = cost.draft_row(drafts + 1) + seconds_per_draft
            if not self.draft_pays(chance, extra, tokens, step_seconds):
                break  # the surest remaining draft does not pay, so none after it does
            heapq.heappop(surest)
            ks[i] += 1
            drafts += 1
            tokens += chance
            step_seconds += extra
            record, room = open_to[i]
            if ks[i] < room:
                heapq.heappush(surest, (-chance * record.rate, i))
        for i, (record, _) in open_to.items():
            if ks[i] == 0:  # not worth it now: pause, then probe
                record.paused_until = step + self.config.pause_steps
                ks[i] = 1 if record.num_drafts else 0
        return ks

    def _cost(self, num_decoding: int, prefill_tokens: int) -> tuple[StepCost, float]:
        """The step-time model's costs, and the step's time without drafts."""
        cost = self.step_time.cost
        step = cost.predict(num_decoding, prefill_tokens)
        if step <= 0:  # every term of the fit clamped to 0 (noise): it knows nothing, the prior does
            cost, step = PRIOR, PRIOR.predict(num_decoding, prefill_tokens)
        return cost, step

    def _room(self, seq: Sequence) -> int:
        """Drafts that fit: room to emit k + 1 tokens within max_tokens and the context window."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    @staticmethod
    def _record(seq: Sequence, step: int, cue: int | None) -> Acceptance | None:
        """The record that prices seq's drafts this step, None if it gets none (no guess, or paused)."""
        if cue is None:
            return None
        record = seq.spec.acceptance(cue)
        return None if step < record.paused_until else record
