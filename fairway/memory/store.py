"""Where memories live: their rows (fact, source conversation, times) in the conversation store's
database, beside the vector index's rows, plus each user's on/off switch and each conversation's
extraction progress and injected block. SQLite and PostgreSQL through one set of queries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fairway.retrieval.sql_index import Json, SqlTables

log = logging.getLogger(__name__)

metadata = sa.MetaData()

memories = sa.Table(
    "memories", metadata,
    sa.Column("memory_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("fact", sa.Text, nullable=False),
    sa.Column("conversation_id", sa.String(64), nullable=True),  # where it was learnt
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Index("ix_memories_user_created", "user_id", "created_at"),
)

memory_users = sa.Table(
    "memory_users", metadata,
    sa.Column("user_id", sa.String(128), primary_key=True),
    sa.Column("enabled", sa.Boolean, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

# One row per conversation memory has seen: when its last turn started, when it was last
# extracted and how many of its messages (oldest first) extraction has read, and the memories
# injected at its start (kept, so later turns repeat the same block).
memory_conversations = sa.Table(
    "memory_conversations", metadata,
    sa.Column("conversation_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("last_turn_at", sa.Double, nullable=False),
    sa.Column("extracted_at", sa.Double, nullable=True),
    sa.Column("extracted_messages", sa.Integer, nullable=False, server_default="0"),
    sa.Column("block", Json, nullable=True),  # [memory_id, ...] injected at the start
    sa.Index("ix_memory_conversations_pending", "last_turn_at"),
)


# A turn's look at memory, one statement: the user's switch, whether there is anything to
# recall, and the block kept for the conversation (NULL: memory has not seen it).
_user, _conversation = sa.bindparam("user_id"), sa.bindparam("conversation_id")
_TURN_STATE = sa.select(
    sa.select(memory_users.c.enabled).where(memory_users.c.user_id == _user).scalar_subquery().label("enabled"),
    sa.exists().where(memories.c.user_id == _user).label("has_memories"),
    sa.select(memory_conversations.c.block).where(memory_conversations.c.conversation_id == _conversation)
    .scalar_subquery().label("block"),
)


NOTES_DELAY_S = 0.1  # note_turn_soon's: turns noted within it are written together


def _note(user_id: str, conversation_id: str, block: Sequence[str] | None) -> dict[str, Any]:
    return {"conversation_id": conversation_id, "user_id": user_id, "last_turn_at": time.time(),
            "block": list(block) if block is not None else None}


@dataclass(frozen=True)
class TurnState:
    enabled: bool
    has_memories: bool
    block: list[str] | None  # the memory ids injected at the conversation's start; None: not seen


@dataclass(frozen=True)
class Memory:
    memory_id: str
    user_id: str
    fact: str
    conversation_id: str | None
    created_at: float
    updated_at: float

    def public(self) -> dict[str, Any]:
        """The seed's shape (GET /v1/user/memory), plus where and when it was learnt."""
        return {"memory_id": self.memory_id, "fact": self.fact, "created_at": int(self.created_at),
                "updated_at": int(self.updated_at), "conversation_id": self.conversation_id}


class MemoryStore(SqlTables):
    metadata = metadata

    def __init__(self, url: str | AsyncEngine, connect_args: dict[str, Any] | None = None) -> None:
        super().__init__(url, connect_args)
        # Built once: the hot path compiles each statement object once.
        noted = self.insert(memory_conversations)
        self._note_turn = noted.on_conflict_do_update(index_elements=["conversation_id"],
                                                      set_={"last_turn_at": noted.excluded.last_turn_at})
        self._note_first_turn = noted.on_conflict_do_update(
            index_elements=["conversation_id"],
            set_={"last_turn_at": noted.excluded.last_turn_at, "block": noted.excluded.block})
        self._notes: dict[str, dict[str, Any]] = {}  # note_turn_soon's, by conversation id
        self._flushing: asyncio.Task | None = None

    async def add(self, memory: Memory) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(memories).values(**vars(memory)))

    async def replace_fact(self, user_id: str, memory_id: str, fact: str, conversation_id: str | None) -> Memory | None:
        async with self.engine.begin() as conn:
            row = (await conn.execute(
                sa.update(memories).where(memories.c.memory_id == memory_id, memories.c.user_id == user_id)
                .values(fact=fact, conversation_id=conversation_id, updated_at=time.time())
                .returning(*memories.c))).first()
        return Memory(**row._mapping) if row else None

    async def list(self, user_id: str) -> list[Memory]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(memories).where(memories.c.user_id == user_id)
                                       .order_by(memories.c.created_at, memories.c.memory_id))).all()
        return [Memory(**r._mapping) for r in rows]

    async def get_many(self, user_id: str, ids: Sequence[str]) -> dict[str, Memory]:
        if not ids:
            return {}
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(memories).where(
                memories.c.user_id == user_id, memories.c.memory_id.in_(list(ids))))).all()
        return {r.memory_id: Memory(**r._mapping) for r in rows}

    async def delete(self, user_id: str, memory_id: str) -> bool:
        async with self.engine.begin() as conn:
            result = await conn.execute(sa.delete(memories).where(
                memories.c.memory_id == memory_id, memories.c.user_id == user_id))
        return result.rowcount > 0

    async def delete_all(self, user_id: str) -> int:
        async with self.engine.begin() as conn:
            result = await conn.execute(sa.delete(memories).where(memories.c.user_id == user_id))
        return result.rowcount

    # -- the user's switch -------------------------------------------------------------------

    async def enabled(self, user_id: str) -> bool:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(memory_users.c.enabled)
                                        .where(memory_users.c.user_id == user_id))).scalar()
        return True if value is None else bool(value)

    async def set_enabled(self, user_id: str, enabled: bool) -> None:
        stmt = self.insert(memory_users).values(user_id=user_id, enabled=enabled, updated_at=time.time())
        stmt = stmt.on_conflict_do_update(index_elements=["user_id"],
                                          set_={"enabled": enabled, "updated_at": stmt.excluded.updated_at})
        async with self.engine.begin() as conn:
            await conn.execute(stmt)

    # -- conversations -----------------------------------------------------------------------

    async def turn_state(self, user_id: str, conversation_id: str) -> TurnState:
        row = (await self.rows(_TURN_STATE, {"user_id": user_id, "conversation_id": conversation_id}))[0]
        block = row["block"]
        noted = self._notes.get(conversation_id)  # chosen here a moment ago, not yet written
        if block is None and noted is not None:
            block = noted["block"]
        return TurnState(row["enabled"] is None or bool(row["enabled"]), bool(row["has_memories"]),
                         None if block is None else list(block))

    async def note_turn(self, user_id: str, conversation_id: str, block: Sequence[str] | None = None) -> None:
        """A turn started now; with block, the memories injected at the conversation's start."""
        values = _note(user_id, conversation_id, block)
        await self.rows(self._note_turn if block is None else self._note_first_turn, values)

    def note_turn_soon(self, user_id: str, conversation_id: str, block: Sequence[str] | None = None) -> None:
        """note_turn, written with the other turns of the next NOTES_DELAY_S in one round trip:
        a chat turn does not wait for it (idle extraction looks minutes later). Lost if the process
        dies meanwhile: that conversation is then extracted after its next turn."""
        values = _note(user_id, conversation_id, block)
        noted = self._notes.get(conversation_id)
        if block is None and noted is not None:
            values["block"] = noted["block"]  # a block not yet written stays
        self._notes[conversation_id] = values
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(NOTES_DELAY_S)
        try:
            await self.flush_notes()
        except Exception:
            log.warning("could not note %d conversation turns for memory", len(self._notes), exc_info=True)

    async def flush_notes(self) -> None:
        """Write the turns noted soon, now."""
        notes, self._notes, self._flushing = self._notes, {}, None
        await self.rows_many(self._note_first_turn, [v for v in notes.values() if v["block"] is not None])
        await self.rows_many(self._note_turn, [v for v in notes.values() if v["block"] is None])

    async def close(self) -> None:
        if self._notes:
            with contextlib.suppress(Exception):
                await self.flush_notes()
        await super().close()

    async def forget_conversation(self, conversation_id: str) -> None:
        """A deleted conversation: nothing left to extract from it, no block to keep (the facts
        learnt from it stay: they are the user's, deleted through the memory API)."""
        self._notes.pop(conversation_id, None)
        async with self.engine.begin() as conn:
            await conn.execute(sa.delete(memory_conversations)
                               .where(memory_conversations.c.conversation_id == conversation_id))

    async def idle_conversations(self, idle_s: float, limit: int = 20) -> list[tuple[str, str, float]]:
        """(user id, conversation id, last turn at) of conversations whose last turn is older than
        idle_s and came after their last extraction, oldest first."""
        c = memory_conversations.c
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(c.user_id, c.conversation_id, c.last_turn_at).where(
                c.last_turn_at < time.time() - idle_s,
                sa.or_(c.extracted_at.is_(None), c.extracted_at < c.last_turn_at))
                .order_by(c.last_turn_at).limit(limit))).all()
        return [(r.user_id, r.conversation_id, r.last_turn_at) for r in rows]

    async def extracted_messages(self, conversation_id: str) -> int:
        """How many of the conversation's messages, oldest first, extraction has read."""
        c = memory_conversations.c
        async with self.engine.connect() as conn:
            count = (await conn.execute(sa.select(c.extracted_messages)
                                        .where(c.conversation_id == conversation_id))).scalar()
        return count or 0

    async def claim_messages(self, user_id: str, conversation_id: str, seen: int, through: int) -> bool:
        """Mark the conversation extracted now, through its first `through` messages, if `seen`
        were read until now: of several extractions at once (the idle pass of several gateways, an
        on-demand one) one reads each message. An extraction counts as the conversation's own even
        before its first turn is noted (its last turn then is now: the idle pass skips it)."""
        c, ts = memory_conversations.c, time.time()
        claim = self.insert(memory_conversations).values(
            conversation_id=conversation_id, user_id=user_id, last_turn_at=ts, extracted_at=ts,
            extracted_messages=through, block=None)
        claim = claim.on_conflict_do_update(
            index_elements=["conversation_id"], where=c.extracted_messages == seen,
            set_={"extracted_at": claim.excluded.extracted_at, "extracted_messages": claim.excluded.extracted_messages})
        async with self.engine.begin() as conn:
            return (await conn.execute(claim.returning(c.conversation_id))).first() is not None

    async def release_messages(self, conversation_id: str, through: int, seen: int) -> bool:
        """Undo claim_messages(seen, through) for an extraction that could not read them (the
        model unavailable): read from `seen` again, by the next idle pass. False if another
        extraction claimed more meanwhile."""
        c = memory_conversations.c
        release = (sa.update(memory_conversations)
                   .where(c.conversation_id == conversation_id, c.extracted_messages == through)
                   .values(extracted_messages=seen, extracted_at=None))
        async with self.engine.begin() as conn:
            return (await conn.execute(release)).rowcount > 0
