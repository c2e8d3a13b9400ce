"""Memory across conversations: facts learnt from a user's conversations, deduplicated by
meaning, looked up by the first message of a new conversation and injected into its hidden
system block.

The block is chosen once, at the conversation's start, and its memory ids are kept: later turns
repeat the same block (minus any memory deleted since), so turn N+1's prompt still begins with
turn N's and the prefix cache keeps serving it.

Each message is extracted once (idle or on demand: the store counts the messages read), so a
memory the user deleted stays deleted: only a new message stating it again brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fairway.conversation.entities import Message, MessageStatus, new_id
from fairway.retrieval import MEMORIES, Embedder, Entry, VectorIndex

from .extract import ExtractionModel, explicit_facts, model_facts
from .store import Memory, MemoryStore

log = logging.getLogger(__name__)

ChatMessage = dict[str, str]
BLOCK_HEADER = "What you remember about the user from earlier conversations (use it when relevant):"


@dataclass
class MemorySettings:
    inject_k: int = 5  # at most this many memories in a conversation's block
    inject_min_score: float = 0.2  # cosine similarity to the first message (MiniLM: related ~0.2-0.6)
    inject_max_tokens: int = 200  # the block's budget
    dedup_score: float = 0.8  # a new fact this similar to a stored one replaces it (MiniLM: a restatement ~0.8-0.97, a different allergy ~0.5)
    idle_s: float = 300.0  # a conversation idle this long gets its facts extracted
    poll_s: float = 10.0
    extraction_attempts: int = 3  # model answers tried per extraction (malformed JSON is retried)


@dataclass(frozen=True)
class MemoryBlock:
    """What a conversation's context gets from memory: its system message (None when empty)."""

    memories: list[Memory] = field(default_factory=list)

    @property
    def message(self) -> ChatMessage | None:
        if not self.memories:
            return None
        return {"role": "system", "content": "\n".join([BLOCK_HEADER, *(f"- {m.fact}" for m in self.memories)])}


def readable(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """A conversation's stored messages as extract() reads them, (role, text) oldest first: a
    flagged one (the input check refused it, or the output check stopped it) without its text, so
    nothing the safety checks refused is learnt, and each keeps its place among the messages read."""
    return [(str(m.role), "" if m.status == MessageStatus.FLAGGED else m.text) for m in messages]


class MemoryService:
    def __init__(self, store: MemoryStore, index: VectorIndex, embedder: Callable[[], Embedder],
                 settings: MemorySettings | None = None, complete: ExtractionModel | None = None,
                 messages_of: Callable[[str], Awaitable[Sequence[tuple[str, str]]]] | None = None) -> None:
        self.store = store
        self.index = index
        self._embedder = embedder  # loads on first call (90 MB, seconds): not at import or startup
        self.settings = settings or MemorySettings()
        self.complete = complete  # the model for extraction; None: explicit statements only
        self.messages_of = messages_of  # a conversation's (role, text) messages, for idle extraction

    async def embed(self, texts: Sequence[str]):  # noqa: ANN201 - np.ndarray
        embedder = await asyncio.to_thread(self._embedder)
        return await asyncio.to_thread(embedder.embed, list(texts))

    async def init(self) -> None:
        await self.store.init()
        await self.index.init()

    async def close(self) -> None:
        await self.store.close()
        await self.index.close()

    # -- writing -----------------------------------------------------------------------------

    async def remember(self, user_id: str, facts: Sequence[str], conversation_id: str | None) -> list[Memory]:
        """Store the facts, each replacing a stored one it restates (similarity >= dedup_score)
        instead of adding a near copy. Returns the memories written, new or replaced."""
        facts = list(dict.fromkeys(f for f in facts if f))
        if not facts:
            return []
        vectors = await self.embed(facts)
        written: list[Memory] = []
        for fact, vector in zip(facts, vectors, strict=True):
            same = await self.index.search(MEMORIES, user_id, vector, 1, self.settings.dedup_score)
            memory = None
            if same:
                memory = await self.store.replace_fact(user_id, same[0].key, fact, conversation_id)
            if memory is None:
                ts = time.time()
                memory = Memory(new_id("mem"), user_id, fact, conversation_id, ts, ts)
                await self.store.add(memory)
            await self.index.upsert(MEMORIES, user_id, [Entry(memory.memory_id, vector, fact)])
            written.append(memory)
        return written

    async def forget(self, user_id: str, memory_id: str) -> bool:
        if not await self.store.delete(user_id, memory_id):
            return False
        await self.index.delete(MEMORIES, user_id, [memory_id])
        return True

    async def forget_all(self, user_id: str) -> int:
        count = await self.store.delete_all(user_id)
        await self.index.delete_partition(MEMORIES, user_id)
        return count

    # -- extraction --------------------------------------------------------------------------

    async def extract(self, user_id: str, conversation_id: str, messages: Sequence[tuple[str, str]],
                      use_model: bool = True) -> list[Memory]:
        """Facts from the conversation's messages ((role, text), all of them, oldest first) that
        no extraction read before: the user's explicit statements, and the model's answer when a
        model is configured (and use_model). Each message is read once, on demand or when idle,
        so a memory the user deleted is not learnt again from the messages it came from. With
        memory off they are read all the same, and nothing is learnt."""
        seen = await self.store.extracted_messages(conversation_id)
        through = max(seen, len(messages))
        if not await self.store.claim_messages(user_id, conversation_id, seen, through):
            return []  # another extraction is reading them
        messages = messages[seen:]
        if not messages or not await self.store.enabled(user_id):
            return []
        # The explicit statements first: stored at once, not after the background lane's wait.
        explicit = [f for role, text in messages if role == "user" for f in explicit_facts(text)]
        written = await self.remember(user_id, explicit, conversation_id)
        if self.complete is not None and use_model:
            try:
                facts = await model_facts(self.complete, messages, self.settings.extraction_attempts)
            except Exception as e:  # the model unavailable: the explicit facts still count
                log.warning("memory extraction by the model failed for %s: %s", conversation_id, e)
                # Its messages are read again by the next idle pass (their explicit statements
                # are the same facts again: remembered in place), not lost to the model for good.
                await self.store.release_messages(conversation_id, through, seen)
            else:
                written += await self.remember(user_id, facts, conversation_id)
        return written

    async def extract_idle(self) -> int:
        """One pass over the conversations idle for settings.idle_s since their last extraction."""
        if self.messages_of is None:
            return 0
        if self.complete is not None and not await self.complete.ready():
            return 0  # no replica serves the model yet (a deployment starting): claim nothing, wait
        done = 0
        for user_id, conversation_id, _ in await self.store.idle_conversations(self.settings.idle_s):
            try:
                await self.extract(user_id, conversation_id, await self.messages_of(conversation_id))
            except Exception:
                log.exception("memory extraction of %s failed", conversation_id)
            done += 1
        return done

    async def run(self) -> None:
        """The idle-extraction loop, for the app's lifetime."""
        while True:
            try:
                await self.extract_idle()
            except Exception:
                log.exception("memory extraction pass failed")
            await asyncio.sleep(self.settings.poll_s)

    # -- reading -----------------------------------------------------------------------------

    async def list(self, user_id: str) -> list[Memory]:
        return await self.store.list(user_id)

    async def recall(self, user_id: str, query: str, count_tokens: Callable[[str], int] | None = None) -> list[Memory]:
        """The user's memories most similar to query, best first, within k, the threshold and the
        token budget."""
        s = self.settings
        if not query.strip() or await self.index.count(MEMORIES, user_id) == 0:
            return []  # nothing to find: the embedder is not even loaded
        vector = (await self.embed([query]))[0]
        hits = await self.index.search(MEMORIES, user_id, vector, s.inject_k, s.inject_min_score)
        found = await self.store.get_many(user_id, [h.key for h in hits])
        count = count_tokens or (lambda text: len(text) // 4 + 1)
        chosen, used = [], 0
        for hit in hits:
            memory = found.get(hit.key)
            if memory is None:
                continue
            cost = count(f"- {memory.fact}\n")
            if used + cost > s.inject_max_tokens:
                break
            chosen.append(memory)
            used += cost
        return chosen

    async def block(self, user_id: str, conversation_id: str, first_message: str,
                    count_tokens: Callable[[str], int] | None = None) -> MemoryBlock:
        """The conversation's memory block: chosen for first_message when the conversation is
        new to memory, else the one chosen then, without memories deleted since. Notes the turn
        (idle extraction starts from it). Empty while the user has memory off, and for good in a
        conversation started with memory off."""
        state = await self.store.turn_state(user_id, conversation_id)
        if state.block is None:  # its first turn: the block is chosen now, for good (memory off: none)
            chosen = await self.recall(user_id, first_message, count_tokens) if state.enabled and state.has_memories else []
            self.store.note_turn_soon(user_id, conversation_id, [m.memory_id for m in chosen])
            return MemoryBlock(chosen)
        self.store.note_turn_soon(user_id, conversation_id)  # while off too: extraction passes its messages over
        if not state.enabled:
            return MemoryBlock()
        found = await self.store.get_many(user_id, state.block)
        return MemoryBlock([found[i] for i in state.block if i in found])
