"""The moderation categories: OpenAI's moderation model's thirteen, named as its API names them."""

from __future__ import annotations

CATEGORIES: tuple[str, ...] = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)

Scores = dict[str, float]  # category -> score in [0, 1]; a category a classifier does not judge is absent


def check_category(name: str) -> str:
    if name not in CATEGORIES:
        raise ValueError(f"unknown moderation category {name!r}: use one of {', '.join(CATEGORIES)}")
    return name
