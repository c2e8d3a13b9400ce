"""Safety configuration: which checks run, the output check's mode, the policy file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fairway.safety.categories import check_category

OutputMode = Literal["check-then-release", "release-then-check"]
OUTPUT_MODES: tuple[str, ...] = ("check-then-release", "release-then-check")


@dataclass
class SafetySettings:
    check_input: bool = True  # the new user message, before routing
    check_output: bool = True  # the reply, sentence by sentence, where tokens enter the token log
    # check-then-release holds back the current sentence until it is checked (nothing flagged
    # reaches a client); release-then-check streams at once and stops the reply after a flagged
    # sentence (which the client has then seen).
    output_mode: OutputMode = "check-then-release"
    max_sentence_chars: int = 300  # a sentence without an end is checked (and released) at this length
    policy_path: str | None = None  # None: the bundled fairway/safety/policy.toml
    profanity_model: bool = True  # alt-profanity-check (the `safety` extra)
    thresholds: dict[str, float] = field(default_factory=dict)  # overrides of the policy's

    def __post_init__(self) -> None:
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {self.output_mode!r}")
        if self.max_sentence_chars < 1:
            raise ValueError("max_sentence_chars must be at least 1")
        for category, value in self.thresholds.items():
            check_category(category)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"the threshold of {category} must be in (0, 1], got {value}")
