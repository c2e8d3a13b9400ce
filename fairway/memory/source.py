"""Memory as a context source of the conversation service: a conversation's memory block goes
after the stable system text (conversation/extras.py)."""

from __future__ import annotations

import logging

from fairway.conversation.extras import TurnExtras, TurnInfo

from .service import MemoryService

log = logging.getLogger(__name__)


class MemorySource:
    def __init__(self, service: MemoryService) -> None:
        self.service = service

    async def extras(self, turn: TurnInfo) -> TurnExtras:
        try:
            block = await self.service.block(turn.user_id, turn.conversation_id, turn.question, turn.count_tokens)
        except Exception:  # memory is an extra: a failing lookup must not fail the chat
            log.exception("memory lookup for %s failed; the turn goes on without memories", turn.conversation_id)
            return TurnExtras(info={"memories": 0})
        message = block.message
        return TurnExtras(head=[message] if message else [],
                          info={"memories": len(block.memories), "memory_ids": [m.memory_id for m in block.memories]})
