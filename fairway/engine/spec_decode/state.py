"""One sequence's speculation: how well its proposals have done, and what each proposer keeps for it."""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the past in the acceptance estimate, per verification (~10 verifications remembered).
ACCEPTANCE_DECAY = 0.9


@dataclass
class Acceptance:
    """How well the drafts of one cue have done for a sequence. Discounted counts of draft tokens
    accepted and tried; a token counts as tried when every draft before it was accepted. The prior
    (1 of 2) lets a new cue start speculating."""

    accepted: float = 1.0
    tried: float = 2.0
    paused_until: int = 0  # engine step before which drafts of this cue are not proposed
    num_drafts: int = 0  # verifications of drafts of this cue

    @property
    def rate(self) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        return self.accepted / self.tried

    def record(self, proposed: int, accepted: int) -> None:
        tried = accepted + (1 if accepted < proposed else 0)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.tried = ACCEPTANCE_DECAY * self.tried + tried
        self.num_drafts += 1


@dataclass
class SpecState:
    # Acceptance by cue: what a proposal rests on (proposer.py). Prompt lookup's guesses after a
    # long n-gram match are accepted far more often than after a one-token match, so each match
    # length is priced on its own record; a draft model has one cue.
    by_cue: dict[int, Acceptance] = field(default_factory=dict)
    cue: int = 0  # the cue of the drafts now being verified (the engine's totals: Speculator)
    draft_computed: int = 0  # tokens whose K/V the draft model holds (draft-model proposer)
    ngram_index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its last earlier match
    ngram_indexed: int = 0  # token positions whose n-grams are in the index

    def acceptance(self, cue: int) -> Acceptance:
        found = self.by_cue.get(cue)
        if found is None:
            found = self.by_cue[cue] = Acceptance()
        return found

    def record(self, proposed: int, accepted: int) -> None:
        """One verification of the current cue's drafts: `accepted` of `proposed` draft tokens
        kept (the rest after the first miss)."""
        self.acceptance(self.cue).record(proposed, accepted)
