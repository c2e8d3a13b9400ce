"""The conversation store interface. One SQL implementation serves SQLite and PostgreSQL
(sql_store.py); the rest of Fairway sees only this class."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .entities import (
    ApiKey,
    Attachment,
    Conversation,
    Message,
    MessageStatus,
    Reply,
    ReplyState,
    Role,
    UsageRecord,
)


class StoreError(Exception):
    pass


class DuplicateClientKey(StoreError):
    """A message with this client_key is already in the conversation: the client resent it."""

    def __init__(self, existing: Message):
        super().__init__(f"client_key {existing.client_key!r} already stored as {existing.id}")
        self.existing = existing


class ConversationBusy(StoreError):
    """A reply to the conversation is still being written. A new turn waits until it has ended
    (or been stopped): two turns at once would each be answered without the other, and the
    history would hold both questions before both answers."""

    def __init__(self, conversation_id: str, reply_id: str | None):
        super().__init__(f"conversation {conversation_id} is still answering (reply {reply_id})")
        self.conversation_id = conversation_id
        self.reply_id = reply_id


class ReplyFinished(StoreError):
    """The reply already reached a final state; final states never change, so a late writer
    (a Stop racing the last token, a dead replica's straggler) cannot overwrite the outcome."""

    def __init__(self, reply_id: str, state: ReplyState):
        super().__init__(f"reply {reply_id} is already {state}")
        self.reply_id = reply_id
        self.state = state


class NotFound(StoreError):
    pass


class StoreUnavailable(StoreError):
    """The database cannot be reached right now (down, restarting, out of connections, or a
    connection lost mid-call): not the caller's fault; retry shortly. A write that failed so may
    or may not have been committed; the store's writes are safe to repeat (client keys, first
    writer wins, one usage record per reply)."""


class InvalidText(StoreError):
    """The database refused text it cannot hold: on PostgreSQL a NUL character (U+0000), or a
    character its encoding lacks; SQLite holds both. The caller's input, not the store's fault:
    the gateway refuses such text before it gets here, and answers this one as a 400 too."""


class DuplicateKey(StoreError):
    """An API key with this hash is already stored."""


@dataclass
class NewTurn:
    """What starting one turn writes, all or nothing (ConversationStore.store_turn): the
    conversation when it is new, the request's messages in order (the last is the user's and
    carries client_key) and the queued reply that answers it; a flagged turn (the input check
    refused it) stores its last message with status flagged and no reply, and any earlier
    message the check flagged (in flagged_earlier) with status flagged too, so that no later
    context holds it; a shed one stores its reply SHED."""

    conversation: Conversation
    new_conversation: bool
    # (role, text[, tools[, attachments]]): a user message's attached files are stored with it, in
    # the statement that stores it (no write of their own on the chat path).
    messages: Sequence[tuple[Role, str] | tuple[Role, str, dict[str, Any] | None]
                       | tuple[Role, str, dict[str, Any] | None, Sequence[Attachment]]]
    client_key: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    replica_id: str | None = None
    job: dict[str, Any] = field(default_factory=dict)
    flagged: bool = False
    # A flagged turn's last message's own categories: none when only an earlier one was flagged.
    flagged_categories: Sequence[str] = ()
    # A flagged turn's earlier messages that the check flagged themselves: index in messages -> categories.
    flagged_earlier: Mapping[int, Sequence[str]] = field(default_factory=dict)
    shed: bool = False  # refused at capacity: the reply is stored SHED (final) at once


# Fields update_reply may change; ids, the answered message and created_at are fixed.
REPLY_UPDATABLE = frozenset(
    {"state", "replica_id", "last_event_id", "finish_reason", "prompt_token_ids", "context_text", "job"}
)


@dataclass(frozen=True)
class Ending:
    """finish_reply's arguments, for finish_replies."""

    reply_id: str
    text: str
    status: MessageStatus
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_event_id: int | None = None
    tools: dict[str, Any] | None = None  # the message's tool calls
    flagged_categories: list[str] | None = None  # status flagged: by which moderation categories


class ConversationStore(ABC):
    """Conversations, their messages and the replies that answer them.

    Ownership is checked where a user names a conversation (get, list, delete): the other
    methods take ids the caller already got through those, so they do not re-check.
    """

    @abstractmethod
    async def init(self) -> None:
        """Create or upgrade the schema (Alembic, to head). Safe to call again."""

    @abstractmethod
    async def close(self) -> None: ...

    @contextlib.asynccontextmanager
    async def one_connection(self) -> AsyncIterator[None]:
        """The calling task's statements inside share one database connection where the store
        checks connections out of a pool per statement (a batch of writes: one checkout, not one
        each). Nothing else changes: each statement still commits by itself."""
        yield

    # conversations

    @abstractmethod
    async def get_conversation(self, id: str, user_id: str) -> Conversation | None:
        """None when missing *or* another user's, so callers answer 404 for both and do not
        reveal that the id exists."""

    @abstractmethod
    async def list_conversations(
        self, user_id: str, limit: int = 50, before: float | None = None
    ) -> list[Conversation]:
        """Newest activity first; `before` is the updated_at of the last one of the previous
        page."""

    @abstractmethod
    async def delete_conversation(self, id: str, user_id: str) -> bool:
        """Deletes the conversation with its messages and replies; False if missing or not
        the user's."""

    # messages

    @abstractmethod
    async def store_turn(self, turn: NewTurn) -> tuple[Message, Reply | None]:
        """In one transaction, the start of a turn: the conversation if it is new (else its
        updated_at bumped), the messages, and the reply (QUEUED) answering the last of them.
        Returns that message and the reply (None for a flagged turn). Nothing is stored if any part fails: a client never
        finds its message without the reply to it. Raises NotFound if an existing conversation is
        gone, DuplicateClientKey (with the stored message) if the client key is already there,
        as when the same request raced in twice (for a new conversation, under the same derived
        id), and ConversationBusy if the conversation's newest reply has not ended: a turn with a
        reply claims the conversation atomically (of two racing turns one is stored). A flagged
        turn claims nothing: no reply answers it, and no context holds it."""

    @abstractmethod
    async def add_reply(self, conversation_id: str, message_id: str, prompt_token_ids: Sequence[int] | None,
                        replica_id: str | None, job: dict[str, Any], shed: bool = False) -> Reply:
        """Another reply (QUEUED, or SHED) to a stored user message: a resend of one whose reply was
        shed. It claims the conversation as store_turn does (ConversationBusy, NotFound)."""

    @abstractmethod
    async def list_messages(self, conversation_id: str) -> list[Message]:
        """Oldest first."""

    @abstractmethod
    async def get_message_by_client_key(self, conversation_id: str, client_key: str) -> Message | None: ...

    # replies

    @abstractmethod
    async def get_reply(self, id: str) -> Reply | None: ...

    @abstractmethod
    async def get_reply_jobs(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored jobs (model, sampling, the gateway's meta) of these replies, without their
        context, by reply id; a reply unknown or without a job is left out. What accounting reads
        for each batch of ended replies, in one round trip."""

    @abstractmethod
    async def get_finish_reasons(self, ids: Sequence[str]) -> dict[str, str]:
        """Why each of these replies ended (OpenAI's finish_reason), by reply id, in one round
        trip; a reply unknown or not ended is left out."""

    @abstractmethod
    async def get_reply_for_message(self, conversation_id: str, message_id: str) -> Reply | None:
        """The newest reply answering this user message (a resent message finds its reply)."""

    @abstractmethod
    async def update_reply(self, id: str, **fields: object) -> Reply | None:
        """Set any of REPLY_UPDATABLE; None if no such reply. Raises ReplyFinished if it is
        already final. Moving to a final state stamps finished_at. The store does not police
        the live transitions (QUEUED → RUNNING …): components may skip writing them; see
        ReplyState.can_become for the full machine."""

    @abstractmethod
    async def claim_restart(self, id: str, restarts: int, replica_id: str) -> Reply | None:
        """Count a run of the unfinished reply from its stored context, on replica_id, if it has
        been restarted exactly `restarts` times so far: of gateways racing to restart it only one
        wins. The reply as it is now, or None if another won (or it ended, or is unknown)."""

    @abstractmethod
    async def mark_running_many(self, started: Sequence[tuple[str, str]]) -> int:
        """Replicas started these (reply id, replica id): each RUNNING on its replica unless it is
        final already (or unknown), in one round trip; how many changed. Reads nothing back:
        update_reply returns the whole reply, whose stored context (thousands of token ids) the
        replica's report has no use for."""

    @abstractmethod
    async def mark_requeued_many(self, requeued: Sequence[tuple[str, str]]) -> int:
        """A failover moved these (reply id, replica id) to another replica, where each waits
        again (RUNNING → RESUMING → QUEUED; the store keeps QUEUED) unless it is final already;
        in one round trip, as mark_running_many; how many changed."""

    async def finish_replies(self, endings: Sequence[Ending]) -> None:
        """finish_reply(look_up_existing=False) of several replies (a batch of replicas' reports,
        mostly saved already by the gateways that relayed them); a backend may do it in one
        round trip. A reply already final, or unknown, is left as it is."""
        for e in endings:
            await self.finish_reply(e.reply_id, e.text, e.status, e.finish_reason, prompt_tokens=e.prompt_tokens,
                                    completion_tokens=e.completion_tokens, cached_tokens=e.cached_tokens,
                                    last_event_id=e.last_event_id, look_up_existing=False, tools=e.tools,
                                    flagged_categories=e.flagged_categories)

    @abstractmethod
    async def finish_reply(
        self,
        reply_id: str,
        text: str,
        status: MessageStatus,
        finish_reason: str | None = None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        last_event_id: int | None = None,
        look_up_existing: bool = True,
        tools: dict[str, Any] | None = None,
        flagged_categories: list[str] | None = None,
    ) -> Message | None:
        """In one transaction: store the assistant message and mark the reply FINISHED,
        STOPPED or FLAGGED (by status). If the reply was already finished with a message, that
        stored message is returned (the first writer wins a Stop/finish race); if it ended
        without one (SHED), raises ReplyFinished. Raises NotFound for an unknown reply.
        Without look_up_existing, a reply already final (or unknown) returns None at once: for
        the second of the two writers of every reply (recorder.py), which needs nothing back."""

    @abstractmethod
    async def list_unfinished_replies(self) -> list[Reply]:
        """Replies not in a final state, oldest first, with their stored context."""

    @abstractmethod
    async def unfinished_reply_ids(self, created_before: float) -> list[str]:
        """The ids of the replies not in a final state created before that time, oldest first:
        what a sweep for lost replies looks at (their contexts, thousands of token ids each, are
        read only for the few it runs again)."""

    # API keys (the gateway's users). Keys are never stored, only their sha256.

    @abstractmethod
    async def add_api_key(self, key: ApiKey) -> ApiKey:
        """Store a new key; raises DuplicateKey if its hash is already stored."""

    @abstractmethod
    async def get_api_key(self, key_hash: str) -> ApiKey | None:
        """The key with this hash, revoked or not (the caller checks)."""

    @abstractmethod
    async def revoke_api_key(self, id_or_hash: str) -> ApiKey | None:
        """Mark the key (by id or hash) revoked now; None if no such key. Revoking twice keeps
        the first time."""

    @abstractmethod
    async def list_api_keys(self, user_id: str | None = None) -> list[ApiKey]:
        """Oldest first; all users' unless user_id is given."""

    # usage

    @abstractmethod
    async def add_usage_many(self, records: Sequence[UsageRecord]) -> set[str]:
        """Store these replies' usage records in one round trip; the reply ids whose record this
        stored. A reply that has one already keeps it, so a report delivered twice is counted
        once."""

    @abstractmethod
    async def get_usage(self, reply_id: str) -> UsageRecord | None: ...

    @abstractmethod
    async def flagged_totals(self, user_id: str, since: float, until: float) -> dict[str, dict[str, int]]:
        """How often the user's messages written in [since, until) were flagged, per category: the
        input check's ({"input": {category: n}}: their own messages) and the output check's
        ({"output": ...}: replies to them)."""

    @abstractmethod
    async def usage_totals(self, user_id: str, first_day: str, last_day: str) -> list[dict[str, Any]]:
        """The user's totals per (day, model) for days first_day..last_day (YYYY-MM-DD, UTC, both
        included), oldest day first: requests, prompt/cached/completion tokens, cost."""
