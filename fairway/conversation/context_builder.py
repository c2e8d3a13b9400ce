"""The context builder: the prompt for one reply, in cache-friendly order, within the window.

Order: the stable system text, then memories, then the history, then this turn's retrieved text
(file chunks for its question), then the new turn. Nothing before the history depends on anything
later, so turn N+1's prompt begins with turn N's system text, memories and history, and the
replica's prefix cache serves all of it again (this turn's retrieved text, chosen for its
question, is the one part a later turn does not repeat).

The prompt is tokenized one message at a time (each message's slice of the rendered chat
template) and the pieces are concatenated. For templates whose messages are delimited by special
tokens (ChatML and most others) this equals tokenizing the whole rendering, and it makes a turn's
tokens independent of what follows it, which is what keeps consecutive prompts prefix-equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import orjson

ChatMessage = dict[str, Any]  # {"role": ..., "content": str}


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...  # token ids run 0..vocab_size - 1

    def id_to_token(self, token_id: int) -> str | None: ...  # the token an id spells (a logit_bias's meaning)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...  # (a template with tool support also takes tools=[...])


class ContextTooLong(ValueError):
    """Even with every old turn dropped, system text + the new turn + max_tokens do not fit."""

    def __init__(self, num_tokens: int, budget: int, window: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's context window is {window} tokens. The system text and the new message "
            f"take {num_tokens} tokens, and {max_tokens} are reserved for the reply (max_tokens), "
            f"which leaves {budget} for the prompt. Shorten the message or lower max_tokens."
        )
        self.num_tokens = num_tokens
        self.budget = budget
        self.window = window
        self.max_tokens = max_tokens


@dataclass(frozen=True)
class Context:
    prompt_token_ids: list[int]
    messages: list[ChatMessage]  # what the prompt holds, in order
    dropped_turns: int = 0  # oldest turns left out so the prompt fits
    dropped_messages: int = 0
    segment_lengths: list[int] = field(default_factory=list, repr=False)  # tokens per message (+ gen prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


def reply_max_tokens(default: int, window: int) -> int:
    """A reply's max_tokens when the request sets none: the default, but at most half the window,
    so a small window still has room for the prompt."""
    return min(default, window // 2)


def split_turns(history: Sequence[ChatMessage]) -> list[list[ChatMessage]]:
    """Whole turns: each starts at a user message and runs to the next one. Anything before the
    first user message (an assistant greeting) is a turn of its own."""
    turns: list[list[ChatMessage]] = []
    for message in history:
        if message["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return turns


# Rendered segments kept per builder: the messages of the conversations in flight, with room.
SEGMENT_CACHE = 8192


def _chained(digest: bytes, message: ChatMessage) -> bytes:
    """A digest of the messages up to and including this one, from the previous one's."""
    try:
        text = orjson.dumps(message, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:  # a lone surrogate, which orjson refuses: still a key (in-process)
        text = json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
        text = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(digest + text, digest_size=16).digest()


class ContextBuilder:
    def __init__(self, tokenizer: ChatTokenizer, window: int) -> None:
        self.tokenizer = tokenizer
        self.window = window  # the model's context length, prompt and reply together
        # Segments repeat turn after turn (the whole history is re-sent each time): cache them.
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)
        # Each message's slice of the rendered template, by the digest of the messages up to it:
        # finding a slice takes rendering every message before it, so without this a conversation
        # of n messages cost n renders of up to n messages every turn (quadratic in its length).
        self._segments: dict[bytes, str] = {}

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text))

    def build(
        self,
        system: Sequence[ChatMessage],
        history: Sequence[ChatMessage],
        new: Sequence[ChatMessage],
        max_tokens: int,
        memories: Sequence[ChatMessage] = (),
        retrieved: Sequence[ChatMessage] = (),
        tools: Sequence[dict[str, Any]] | None = None,
        prepare: Callable[[Sequence[ChatMessage]], list[ChatMessage]] | None = None,
    ) -> Context:
        """The prompt for system + memories + history + retrieved + new, dropping whole oldest
        turns of the history (never the system text, memories, retrieved text or the new turn)
        until it fits the window minus max_tokens. Raises ContextTooLong when even the shortest
        form does not fit. tools: for a template that renders them itself. prepare: the messages
        as the template takes them (tool calls and results as text, fairway/tools/prompt.py),
        applied after the turns are told apart by their roles (a tool result starts no turn)."""
        budget = self.window - max_tokens
        head = [*system, *memories]
        turns = split_turns(history)
        dropped = 0
        while True:
            kept = [m for turn in turns[dropped:] for m in turn]
            messages = [*head, *kept, *retrieved, *new]
            ids, lengths = self.tokenize(prepare(messages) if prepare else messages, tools)
            if len(ids) <= budget:
                dropped_messages = sum(len(t) for t in turns[:dropped])
                return Context(ids, messages, dropped, dropped_messages, lengths)
            if dropped == len(turns):
                raise ContextTooLong(len(ids), max(budget, 0), self.window, max_tokens)
            dropped = self._next_drop(turns, dropped, lengths[len(head) :], len(ids) - budget)

    @staticmethod
    def _next_drop(turns: list[list[ChatMessage]], dropped: int, lengths: list[int], excess: int) -> int:
        """Skip ahead past as many turns as their segments' tokens suggest (re-checked by the caller,
        since a template may render the new first message differently), at least one."""
        start, i = dropped, 0
        for turn in turns[dropped:]:
            if excess <= 0:
                break
            excess -= sum(lengths[i : i + len(turn)])
            i += len(turn)
            dropped += 1
        return max(dropped, start + 1)

    def tokenize(self, messages: Sequence[ChatMessage],
                 tools: Sequence[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """Prompt token ids for the messages plus the generation prompt, one segment per message."""
        extra = {"tools": list(tools)} if tools else {}

        def render(msgs: list[ChatMessage], add_generation_prompt: bool) -> str:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **extra)

        ids: list[int] = []
        lengths: list[int] = []
        parts: list[str] = []  # the segments so far: together, the rendering of the messages so far
        # The tools a template renders are part of every segment's text: they seed the digests.
        digest = _chained(b"", {"tools": extra["tools"]}) if extra else b""
        for i, message in enumerate(messages):
            digest = _chained(digest, message)
            segment = self._segments.get(digest)
            if segment is None:
                text = render(list(messages[: i + 1]), add_generation_prompt=False)
                previous = "".join(parts)
                if not text.startswith(previous):
                    # A template that rewrites earlier messages: no stable segments, tokenize whole.
                    whole = list(self._encode(render(list(messages), add_generation_prompt=True)))
                    return whole, [len(whole)]
                segment = self._remember(digest, text[len(previous) :])
            piece = self._encode(segment)
            ids.extend(piece)
            lengths.append(len(piece))
            parts.append(segment)
        previous = "".join(parts)
        full = render(list(messages), add_generation_prompt=True)
        generation_prompt = self._encode(full[len(previous) :]) if full.startswith(previous) else ()
        ids.extend(generation_prompt)
        lengths.append(len(generation_prompt))
        return ids, lengths

    def _remember(self, digest: bytes, segment: str) -> str:
        if len(self._segments) >= SEGMENT_CACHE:
            del self._segments[next(iter(self._segments))]  # the oldest
        self._segments[digest] = segment
        return segment

    def count(self, messages: Sequence[ChatMessage]) -> int:
        return len(self.tokenize(messages)[0])
