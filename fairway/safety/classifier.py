"""The one classifier interface, and the Moderator that combines classifiers into one result.

A Classifier scores texts in the categories it knows (categories.py). The fast ones here (the
policy's patterns, the profanity model) take microseconds on a chat message and run inline; a
heavier one (a Llama Guard-style model run through the engine) implements the same async
score_many(), so callers (the input check, the output check, /v1/moderations) do not change when
one is added.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

from fairway.safety.categories import CATEGORIES, Scores
from fairway.safety.result import ModerationResult, judged
from fairway.usage import metrics

Stage = Literal["input", "output", "api"]


class Classifier(ABC):
    name: str = ""

    @abstractmethod
    async def score_many(self, texts: Sequence[str]) -> list[Scores]:
        """Each text's scores in [0, 1], for the categories this classifier judges."""


# Texts longer than this together are scored in a worker thread. Scoring time grows with the
# text (the policy's regexes are tried at every position): a body of the largest size the gateway
# takes, scored inline, would hold the event loop, and every stream the process relays, for
# seconds. From a thread the loop gets the GIL back between one regex search and the next (a
# search runs in C, holding it), so it pauses for one category's search at most.
INLINE_CHARS = 8_000


class FastClassifier(Classifier):
    """A classifier cheap enough to run in the caller's thread, one text at a time (long texts:
    in a worker thread, see INLINE_CHARS)."""

    @abstractmethod
    def score(self, text: str) -> Scores: ...

    async def score_many(self, texts: Sequence[str]) -> list[Scores]:
        if sum(map(len, texts)) <= INLINE_CHARS:
            return [self.score(text) for text in texts]
        return await asyncio.to_thread(lambda: [self.score(text) for text in texts])


class Moderator:
    """Every classifier's scores, the highest per category, against the thresholds. A score in a
    sub-category ("self-harm/intent") counts for its parent ("self-harm") too."""

    def __init__(self, classifiers: Sequence[Classifier], thresholds: dict[str, float]) -> None:
        missing = [c for c in CATEGORIES if c not in thresholds]
        if missing:
            raise ValueError(f"no threshold for {', '.join(missing)}")
        self.classifiers = list(classifiers)
        self.thresholds = dict(thresholds)

    async def moderate(self, texts: Sequence[str], stage: Stage = "api") -> list[ModerationResult]:
        start = time.perf_counter()
        results = await self._judge(texts)
        metrics.observe_safety(stage, time.perf_counter() - start,
                               [c for r in results for c in r.flagged_categories])
        return results

    async def moderate_together(self, views: Sequence[str], stage: Stage) -> ModerationResult:
        """One verdict on several views of one text (a sentence alone, and with the sentences
        before it): flagged where any view is, and counted once in the metrics, as one text."""
        start = time.perf_counter()
        result = self.combined(await self._judge(views))
        metrics.observe_safety(stage, time.perf_counter() - start, result.flagged_categories)
        return result

    async def _judge(self, texts: Sequence[str]) -> list[ModerationResult]:
        combined: list[Scores] = [{} for _ in texts]
        for classifier in self.classifiers:
            for scores, more in zip(combined, await classifier.score_many(texts), strict=True):
                for category, score in more.items():
                    if score > scores.get(category, 0.0):
                        scores[category] = score
        return [judged(_with_parents(scores), self.thresholds) for scores in combined]

    async def moderate_one(self, text: str, stage: Stage = "api") -> ModerationResult:
        return (await self.moderate([text], stage))[0]

    def combined(self, results: Sequence[ModerationResult]) -> ModerationResult:
        """One result for several texts judged together (one turn's messages): the highest score
        per category, so a category is flagged when it is in any of them."""
        scores: Scores = {}
        for result in results:
            for category, score in result.category_scores.items():
                scores[category] = max(score, scores.get(category, 0.0))
        return judged(scores, self.thresholds)


def _with_parents(scores: Scores) -> Scores:
    for category, score in list(scores.items()):
        parent = category.partition("/")[0]
        if parent != category and score > scores.get(parent, 0.0):
            scores[parent] = score
    return scores
