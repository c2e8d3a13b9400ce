"""One text's moderation result, in the shape of OpenAI's moderation API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fairway.safety.categories import CATEGORIES


@dataclass(frozen=True)
class ModerationResult:
    flagged: bool
    categories: dict[str, bool]  # every category: over its threshold or not
    category_scores: dict[str, float]  # every category: the highest score any classifier gave

    @property
    def flagged_categories(self) -> list[str]:
        """The categories over their thresholds, in CATEGORIES order."""
        return [c for c in CATEGORIES if self.categories.get(c)]

    def to_openai(self) -> dict[str, Any]:
        """One entry of a moderation response's `results` (category_applied_input_types: text
        is the only input type here)."""
        return {
            "flagged": self.flagged,
            "categories": dict(self.categories),
            "category_scores": dict(self.category_scores),
            "category_applied_input_types": {c: ["text"] if self.categories[c] else [] for c in CATEGORIES},
        }


def judged(scores: dict[str, float], thresholds: dict[str, float]) -> ModerationResult:
    """The result for combined scores: a category is flagged at or over its threshold."""
    full = {c: round(float(scores.get(c, 0.0)), 6) for c in CATEGORIES}
    over = {c: full[c] >= thresholds[c] for c in CATEGORIES}
    return ModerationResult(any(over.values()), over, full)
