"""The conversation store's entities: Conversation 1—* Message, Message (user) 1—* Reply.

Times are Unix seconds as floats: the same on SQLite and PostgreSQL, exact through both, and
what the API hands to clients anyway.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fairway.domain import MessageStatus, ReplyState


class Role(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    SYSTEM = "system"
    TOOL = "tool"  # a tool's result, sent back by the client


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"  # (uuid4 costs 4x the time for the same randomness)


_last_now = 0.0


def now() -> float:
    """Wall-clock seconds, strictly increasing within this process, so two messages written
    back to back never tie and list in the order they were written."""
    global _last_now
    _last_now = max(time.time(), _last_now + 1e-6)
    return _last_now


@dataclass
class Conversation:
    id: str
    user_id: str
    tier: str  # free / paid / business: the gateway's tiers, stored as given
    model: str
    title: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0  # last message or reply: conversations list newest first by it


@dataclass(frozen=True)
class Attachment:
    """A file a user message attached, as it was when sent: what a reopened conversation shows of
    it, even once the file itself is deleted."""

    file_id: str
    filename: str
    bytes: int
    content_type: str


@dataclass
class Message:
    id: str
    conversation_id: str
    role: Role
    text: str
    client_key: str | None = None  # the client's message id: a resend with it is a duplicate
    status: MessageStatus = MessageStatus.COMPLETE
    created_at: float = 0.0
    reply_id: str | None = None  # on an assistant message: the reply that wrote it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # An assistant message's tool calls {"calls": [...]} (fairway/tools/record.py), or a tool
    # message's {"tool_call_id": ...}; None for a message without tools.
    tools: dict[str, Any] | None = None
    # A flagged message (the input check refused it, the output check stopped it): which of the
    # moderation categories did, by name; None for any other.
    flagged_categories: list[str] | None = None
    # A user message's attached files, in the order it attached them; None for a message without.
    attachments: list[Attachment] | None = None


@dataclass
class Reply:
    id: str
    conversation_id: str
    message_id: str  # the user message it answers
    state: ReplyState = ReplyState.QUEUED
    replica_id: str | None = None
    last_event_id: int = 0  # the last token-log event n written for it
    finish_reason: str | None = None
    # The prompt as token ids (and/or text): enough to resubmit the reply as a continuation
    # once its token log has expired or its replica died.
    prompt_token_ids: list[int] | None = field(default=None, repr=False)
    context_text: str | None = field(default=None, repr=False)
    created_at: float = 0.0
    finished_at: float | None = None
    # The generation request (model, sampling parameters, lane) as JSON: with the prompt, what
    # it takes to run the reply again after its token log expired.
    job: dict[str, Any] | None = field(default=None, repr=False)
    # Times it ran again from that context after its token log was lost (a restarted process, a
    # Redis that lost it): each run's log numbers its events from 1 again.
    restarts: int = 0

    @property
    def finished(self) -> bool:
        return self.state.terminal


@dataclass
class ApiKey:
    """A bearer key, stored as its sha256 only (keys are high-entropy random strings, so a fast
    hash is enough: nothing to brute-force). `prefix` is the first characters, for lists."""

    id: str
    user_id: str
    tier: str  # paid / free / business / background: picks the quotas and the lane
    key_hash: str
    prefix: str = ""
    name: str = ""
    created_at: float = 0.0
    revoked_at: float | None = None
    region: str | None = None  # where its requests are served unless they name a region (X-Fairway-Region)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass
class UsageRecord:
    """What one reply used and cost: one record per reply (reply_id is unique)."""

    id: str
    reply_id: str
    user_id: str
    model: str
    tier: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # submission to first token
    duration_s: float = 0.0  # submission to the final event
    finish_reason: str = ""
    cost: float = 0.0
    created_at: float = 0.0
    day: str = ""  # UTC date, YYYY-MM-DD: what usage is totalled by
