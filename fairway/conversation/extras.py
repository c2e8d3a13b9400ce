"""What other parts add to a turn's context (memories, retrieved file chunks), behind one small
interface, so the conversation service needs to know neither: stack.py hands it the sources."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

ChatMessage = dict[str, Any]


@dataclass(frozen=True)
class TurnInfo:
    user_id: str
    conversation_id: str
    new_conversation: bool
    question: str  # the new user message's text
    file_ids: list[str] = field(default_factory=list)  # files the new message attaches
    count_tokens: Callable[[str], int] = len


@dataclass
class TurnExtras:
    # After the stable system text, before history: the same on every turn of a conversation.
    head: list[ChatMessage] = field(default_factory=list)
    # Right before the new turn: this turn's own (retrieved for its question), never stored.
    retrieved: list[ChatMessage] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # into the response's context info

    def add(self, other: TurnExtras) -> None:
        self.head += other.head
        self.retrieved += other.retrieved
        self.info.update(other.info)


class ContextSource(Protocol):
    async def extras(self, turn: TurnInfo) -> TurnExtras: ...
