"""The policy layer: per-category terms and patterns from a data file operators edit
(policy.toml, the format is described at its top), matched in the folded text (normalize.py)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fairway.safety.categories import CATEGORIES, Scores, check_category
from fairway.safety.classifier import FastClassifier
from fairway.safety.normalize import LEET_FORMS, fold, squeeze, unleet

DEFAULT_POLICY = Path(__file__).with_name("policy.toml")
_LIST_REF = re.compile(r"\{([a-z_]+)\}")  # {name}; a quantifier {2,5} has digits, never letters
# Not preceded / followed by a letter or digit: whole words, even when a term starts or ends with
# a l33t symbol ($hit).
_START, _END = r"(?<![^\W_])", r"(?![^\W_])"
# How many more characters than a term spells a letter's run may have, and the most between words.
_LONGER, _SEPARATOR = 5, 6


@dataclass(frozen=True)
class ProfanitySettings:
    category: str = "harassment"
    untargeted_weight: float = 0.5
    targets: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Policy:
    thresholds: dict[str, float]
    profanity: ProfanitySettings = field(default_factory=ProfanitySettings)
    # per category: its terms as one regex (whole words, in the squeezed view) and its patterns as one
    matchers: dict[str, tuple[re.Pattern[str] | None, re.Pattern[str] | None]] = field(default_factory=dict)

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
            # Two regexes per category: its terms (whole words) and any of its patterns.
            matchers[category] = (re.compile(_START + "(?:" + "|".join(terms) + ")" + _END) if terms else None,
                                  re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None)
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
        plain, squeezed = unleet(folded), squeeze(folded)
        found: dict[str, str | None] = {}
        for category, (terms, patterns) in self.policy.matchers.items():
            hit = terms.search(squeezed) if terms else None  # (terms match l33t forms themselves)
            if hit is None and patterns:
                hit = patterns.search(folded)
                if hit is None and plain != folded:
                    hit = patterns.search(plain)  # patterns need l33t read as letters
            found[category] = hit.group() if hit else None
        return found


def _term_pattern(term: str) -> str:
    """A term as a regex: each letter in its l33t forms, repeated or not (a doubled letter one run);
    words separated by anything that is not a letter (or nothing); a trailing * takes any ending.
    Each letter's run and each separator is at most a few characters long: unbounded, a long run
    that two neighbours can both take (l|l|l... for l, -*-*-... for a separator and a vowel) is
    split every way from each place a term could start, in quadratic time. Runs the text spells
    longer are cut in the view terms see (normalize.squeeze)."""
    words = []
    for word in fold(term).split():
        prefix = word.endswith("*")
        parts = []
        for run in re.finditer(r"(.)\1*", word.rstrip("*")):
            ch, n = run.group(1), len(run.group())
            repeats = f"{{{n},{n + _LONGER}}}"
            if ch in LEET_FORMS:
                parts.append("[" + "".join(re.escape(c) for c in LEET_FORMS[ch]) + "]" + repeats)
            elif ch == "'":
                parts.append("'?" * n)
            elif ch.isalnum():
                parts.append(re.escape(ch) + repeats)
            else:
                parts.append(re.escape(ch) * n)
        words.append("".join(parts) + (r"\w*" if prefix else ""))
    return rf"[\W_]{{0,{_SEPARATOR}}}".join(words)


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
