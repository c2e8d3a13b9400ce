"""The output check of one reply: its text, sentence by sentence, checked before (or, in the
release-then-check mode, right after) it is released.

A sentence ends at . ! ? (and their CJK forms), … or a newline, or after max_sentence_chars
without one, so nothing is held for ever. Tokens are not split: the token in which a sentence
ends closes it, together with whatever that token carries after the end.

Each sentence is judged alone and together with the sentences released before it (up to
max_sentence_chars of them): the input check judges a message whole, and a phrase cut by a
sentence end ("k.", "i.", "l.", "l yourself"; "a pipe" newline "bomb") or by the length bound
would otherwise pass the output check piece by piece. Alone too, because a longer text can score
lower (the profanity model's weights are normalized over all its words).

Items are whatever the caller releases (the replica's token events); this knows only their text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from fairway.safety.classifier import Moderator
from fairway.safety.config import OutputMode
from fairway.safety.result import ModerationResult

T = TypeVar("T")
_SENTENCE_END = re.compile(r"[.!?\n。！？…]")


@dataclass
class Checked(Generic[T]):
    release: list[T] = field(default_factory=list)  # to release now, in order
    flagged: ModerationResult | None = None  # set: the reply stops here (after releasing `release`)


class HoldBack(Generic[T]):
    def __init__(self, moderator: Moderator, mode: OutputMode = "check-then-release",
                 max_sentence_chars: int = 300) -> None:
        self.moderator = moderator
        self.hold = mode == "check-then-release"
        self.max_chars = max_sentence_chars
        self._items: list[T] = []  # held (check-then-release only)
        self._text: list[str] = []  # the current sentence
        self._chars = 0
        self._before: list[str] = []  # the last sentences that passed, max_chars together (or the last one)

    @property
    def held(self) -> int:
        return len(self._items)

    async def push(self, item: T, text: str) -> Checked[T]:
        """One more token: what may be released now, and whether the sentence it ends was flagged."""
        self._text.append(text)
        self._chars += len(text)
        if self.hold:
            self._items.append(item)
        released = [] if self.hold else [item]
        if _SENTENCE_END.search(text) is None and self._chars < self.max_chars:
            return Checked(released)
        return await self._check(released)

    async def finish(self) -> Checked[T]:
        """At the reply's end: check what is left of the last sentence."""
        return await self._check([])

    async def _check(self, released: list[T]) -> Checked[T]:
        sentence, items = "".join(self._text), self._items
        self._text, self._items, self._chars = [], [], 0
        if sentence.strip():
            views = [sentence, "".join(self._before) + sentence] if self._before else [sentence]
            result = await self.moderator.moderate_together(views, "output")
            if result.flagged:
                return Checked(released, result)  # in check-then-release, the held items are dropped
            self._passed(sentence)
        return Checked(released + items)

    def _passed(self, sentence: str) -> None:
        self._before.append(sentence)
        total = sum(map(len, self._before))
        while len(self._before) > 1 and total > self.max_chars:
            total -= len(self._before.pop(0))
