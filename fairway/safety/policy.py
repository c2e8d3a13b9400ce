"""The policy layer: per-category terms and patterns from a data file operators edit
(policy.toml, the format is described at its top), matched in the folded text (normalize.py)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fairway.safety.categories import CATEGORIES, Scores, check_category
from fairway.safety.classifier import FastClassifier
from fairway.safety.normalize import LEET_FORMS, fold, unleet

DEFAULT_POLICY = Path(__file__).with_name("policy.toml")
_LIST_REF = re.compile(r"\{([a-z_]+)\}")  # {name}; a quantifier {2,5} has digits, never letters
# Not preceded / followed by a letter or digit: whole words, even when a term starts or ends with
# a l33t symbol ($hit).
_START, _END = r"(?<![^\W_])", r"(?![^\W_])"


@dataclass(frozen=True)
class ProfanitySettings:
    category: str = "harassment"
    untargeted_weight: float = 0.5
    targets: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Policy:
    thresholds: dict[str, float]
    profanity: ProfanitySettings = field(default_factory=ProfanitySettings)
    matchers: dict[str, tuple[re.Pattern[str] | None, bool]] = field(default_factory=dict)  # (regex, has patterns)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Policy:
        """Read and compile a policy file (the bundled one by default); ValueError names what is wrong."""
        path = Path(path) if path else DEFAULT_POLICY
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the safety policy {path}: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "policy") -> Policy:
        thresholds = {check_category(c): float(v) for c, v in (data.get("thresholds") or {}).items()}
        missing = [c for c in CATEGORIES if c not in thresholds]
        if missing:
            raise ValueError(f"{source}: [thresholds] has no value for {', '.join(missing)}")
        if not all(0.0 < v <= 1.0 for v in thresholds.values()):
            raise ValueError(f"{source}: thresholds must be in (0, 1]")
        raw = data.get("profanity") or {}
        profanity = ProfanitySettings(check_category(raw.get("category", "harassment")),
                                      float(raw.get("untargeted_weight", 0.5)),
                                      frozenset(fold(t) for t in raw.get("targets", ())))
        lists = {name: str(value).replace("\n", "") for name, value in (data.get("lists") or {}).items()}
        matchers = {}
        for category, section in (data.get("categories") or {}).items():
            check_category(category)
            terms = [_term_pattern(t) for t in section.get("terms", ()) if t.strip()]
            patterns = [_expand(p, lists, f"{source}: {category}") for p in section.get("patterns", ())]
            _check_each(terms, f"{source}: {category} terms")
            _check_each(patterns, f"{source}: {category} patterns")
            # One regex per category: the terms (whole words) or any pattern, one search a text.
            either = ([_START + "(?:" + "|".join(terms) + ")" + _END] if terms else []) + patterns
            matchers[category] = (re.compile("|".join(f"(?:{a})" for a in either)) if either else None,
                                  bool(patterns))
        return cls(thresholds, profanity, matchers)


class PolicyClassifier(FastClassifier):
    """Scores 1.0 in each category whose terms or patterns match, 0.0 in the others."""

    name = "policy"

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def score(self, text: str) -> Scores:
        return {category: 1.0 if match else 0.0 for category, match in self.matches(text).items()}

    def matches(self, text: str) -> dict[str, str | None]:
        """Per category, the first text that matched (or None): what an operator looks at."""
        folded = fold(text)
        plain = unleet(folded)
        found: dict[str, str | None] = {}
        for category, (regex, has_patterns) in self.policy.matchers.items():
            hit = regex.search(folded) if regex else None
            if hit is None and has_patterns and plain != folded:
                hit = regex.search(plain)  # (terms match l33t forms themselves; patterns need this view)
            found[category] = hit.group() if hit else None
        return found


def _term_pattern(term: str) -> str:
    """A term as a regex: each letter in its l33t forms, repeated or not; words separated by
    anything that is not a letter (or nothing); a trailing * takes any ending."""
    words = []
    for word in fold(term).split():
        prefix = word.endswith("*")
        parts = []
        for ch in word.rstrip("*"):
            if ch in LEET_FORMS:
                parts.append("[" + "".join(re.escape(c) for c in LEET_FORMS[ch]) + "]+")
            elif ch == "'":
                parts.append("'?")
            elif ch.isalnum():
                parts.append(re.escape(ch) + "+")
            else:
                parts.append(re.escape(ch))
        words.append("".join(parts) + (r"\w*" if prefix else ""))
    return r"[\W_]*".join(words)


def _expand(pattern: str, lists: dict[str, str], where: str) -> str:
    def splice(m: re.Match[str]) -> str:
        if m.group(1) not in lists:
            raise ValueError(f"{where}: no list named {m.group(1)!r} in [lists]")
        return f"(?:{lists[m.group(1)]})"

    return _LIST_REF.sub(splice, pattern)


def _check_each(alternatives: list[str], where: str) -> None:
    """Compile each alone first, so a mistake is reported with the pattern it is in."""
    for alternative in alternatives:
        try:
            re.compile(alternative)
        except re.error as exc:
            raise ValueError(f"{where}: bad pattern {alternative!r}: {exc}") from None
