"""The domain's words, defined once: reply states, message statuses, finish reasons, tool call
states, tiers, lanes and engine priorities. Every layer imports them from here (this module imports nothing of
Fairway's), so a state or a lane means the same thing in the engine, the relay, the store and
on the wire.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ReplyState(StrEnum):
    """The seeds' "Reply state machine"."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    RESUMING = "RESUMING"
    FINISHED = "FINISHED"
    STOPPED = "STOPPED"
    FLAGGED = "FLAGGED"
    SHED = "SHED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    def can_become(self, other: ReplyState) -> bool:
        """Whether the state machine allows self -> other (staying put is always allowed for a
        live reply, e.g. a new replica or last event id on a RUNNING reply)."""
        if self.terminal:
            return False
        return other == self or other in _NEXT[self]


TERMINAL_STATES = frozenset({ReplyState.FINISHED, ReplyState.STOPPED, ReplyState.FLAGGED, ReplyState.SHED})

# Stop is also accepted while a reply waits (queued, preempted, resuming): a user can press Stop,
# or walk away, before the first token.
_NEXT: dict[ReplyState, frozenset[ReplyState]] = {
    ReplyState.QUEUED: frozenset({ReplyState.RUNNING, ReplyState.SHED, ReplyState.STOPPED}),
    ReplyState.RUNNING: frozenset({ReplyState.PREEMPTED, ReplyState.RESUMING, ReplyState.FINISHED,
                                   ReplyState.STOPPED, ReplyState.FLAGGED}),
    ReplyState.PREEMPTED: frozenset({ReplyState.QUEUED, ReplyState.STOPPED}),
    ReplyState.RESUMING: frozenset({ReplyState.QUEUED, ReplyState.STOPPED}),
}


class MessageStatus(StrEnum):
    """An assistant message's status in the store."""

    COMPLETE = "complete"
    STOPPED = "stopped"  # user Stop, or nobody listening for 30 s: the text so far is kept
    FLAGGED = "flagged"  # the output check stopped it


# The terminal states that leave a message, and its status (a SHED reply leaves none).
STATUS_OF_STATE: dict[ReplyState, MessageStatus] = {
    ReplyState.FINISHED: MessageStatus.COMPLETE,
    ReplyState.STOPPED: MessageStatus.STOPPED,
    ReplyState.FLAGGED: MessageStatus.FLAGGED,
}
STATE_OF_STATUS: dict[MessageStatus, ReplyState] = {status: state for state, status in STATUS_OF_STATE.items()}


class FinishReason(StrEnum):
    """Why a reply (or one engine sequence) ended; the first three are OpenAI's."""

    STOP = "stop"  # a stop token or stop string; also a user's Stop (the text is kept)
    LENGTH = "length"  # max_tokens or the context window
    CONTENT_FILTER = "content_filter"  # the output check stopped it
    TOOL_CALLS = "tool_calls"  # the reply asks the client to run its tool calls
    ABORT = "abort"  # cancelled or failed: the reply did not end on its own


class ToolStatus(StrEnum):
    """One tool call's state, as a reply's tool events say it."""

    CALL = "call"  # a client-defined tool: the client runs it (the reply ends with tool_calls)
    RUNNING = "running"  # a built-in tool (execute_code) runs; the reply is paused
    COMPLETED = "completed"  # it ran; its output went back to the model
    FAILED = "failed"  # it could not run, or ran and failed (an error, a limit); said to the model too


class Tier(StrEnum):
    """A user's tier (from their API key): limits and the lane their replies run in."""

    PAID = "paid"
    FREE = "free"
    BUSINESS = "business"
    BACKGROUND = "background"


class Lane(StrEnum):
    """A job queue's lanes, claimed paid before free before background."""

    PAID = "paid"
    FREE = "free"
    BACKGROUND = "background"


LANE_ORDER: tuple[Lane, ...] = (Lane.PAID, Lane.FREE, Lane.BACKGROUND)  # claim priority, highest first

LANE_OF_TIER: dict[Tier, Lane] = {Tier.PAID: Lane.PAID, Tier.BUSINESS: Lane.PAID, Tier.FREE: Lane.FREE,
                                  Tier.BACKGROUND: Lane.BACKGROUND}


def lane_of_tier(tier: str | None) -> Lane:
    """The lane of a tier; an unknown or missing tier runs as free."""
    try:
        return LANE_OF_TIER[Tier(tier)] if tier else Lane.FREE
    except ValueError:
        return Lane.FREE


class Priority(IntEnum):
    """An engine sequence's priority, lower first: the lanes inside one replica."""

    PAID = 0
    FREE = 1
    BACKGROUND = 2


PRIORITY_OF_LANE: dict[Lane, Priority] = {Lane.PAID: Priority.PAID, Lane.FREE: Priority.FREE,
                                          Lane.BACKGROUND: Priority.BACKGROUND}


# OpenAI's bounds on what a request adds to its logits (the gateway's 400s and the engine's own
# checks alike): presence and frequency penalties in [-MAX_PENALTY, MAX_PENALTY]; logit_bias on at
# most MAX_LOGIT_BIAS_ENTRIES token ids, each within [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_PENALTY = 2
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100
# OpenAI's top_logprobs: the most likely tokens a reply may ask for at each position, 0..MAX_TOP_LOGPROBS.
MAX_TOP_LOGPROBS = 20
