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
        """Compile a policy read from TOML; a ValueError names the file and the place of a mistake.
        Every key is checked: a misspelt one ("term") would otherwise be ignored, its words never
        matched, and a string where a list belongs would be read one character at a time (a
        pattern "a|b" split into "a", "|", "b": the empty alternative matches every text)."""
        _known(data, _TOP_KEYS, source)
        thresholds = {_category(c, f"{source}: [thresholds]"): _fraction(v, f"{source}: [thresholds] {c}")
                      for c, v in _table(data, "thresholds", source).items()}
        missing = [c for c in CATEGORIES if c not in thresholds]
        if missing:
            raise ValueError(f"{source}: [thresholds] has no value for {', '.join(missing)}")
        profanity = _profanity(_table(data, "profanity", source), f"{source}: [profanity]")
        lists = {name: _string(value, f"{source}: [lists] {name}").replace("\n", "")
                 for name, value in _table(data, "lists", source).items()}
        matchers = {}
        for category, section in _table(data, "categories", source).items():
            where = f'{source}: [categories."{category}"]'
            _category(category, where)
            if not isinstance(section, dict):
                raise ValueError(f"{where} must be a table of terms and patterns")
            _known(section, _SECTION_KEYS, where)
            terms = [_term_pattern(_checked_term(t, f"{where} terms")) for t in _strings(section, "terms", where)
                     if t.strip()]
            patterns = [_expand(p, lists, where) for p in _strings(section, "patterns", where)]
            _check_each(terms, f"{where} terms")
            _check_each(patterns, f"{where} patterns")
            # Two regexes per category: its terms (whole words) and any of its patterns.
            matchers[category] = (re.compile(_START + "(?:" + "|".join(terms) + ")" + _END) if terms else None,
                                  re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None)
        return cls(thresholds, profanity, matchers)


_TOP_KEYS = frozenset({"thresholds", "profanity", "lists", "categories"})
_SECTION_KEYS = frozenset({"terms", "patterns"})
_PROFANITY_KEYS = frozenset({"category", "untargeted_weight", "targets"})


def _known(table: dict, allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}: use {', '.join(sorted(allowed))}")


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{where}: [{key}] must be a table, got {type(value).__name__}")
    return value


def _category(name: str, where: str) -> str:
    try:
        return check_category(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}")
    return value


def _strings(table: dict, key: str, where: str) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of strings, got {value!r}")
    return value


def _fraction(value: object, where: str, *, zero: bool = False) -> float:
    """A number in (0, 1] (a threshold), or [0, 1] with zero (a weight): a score past 1 is no score."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (0.0 <= value if zero else 0.0 < value)
    if not ok or not value <= 1.0:  # (NaN fails both)
        raise ValueError(f"{where} must be a number in {'[0, 1]' if zero else '(0, 1]'}, got {value!r}")
    return float(value)


def _profanity(raw: dict, where: str) -> ProfanitySettings:
    _known(raw, _PROFANITY_KEYS, where)
    return ProfanitySettings(_category(_string(raw.get("category", "harassment"), f"{where} category"), where),
                             _fraction(raw.get("untargeted_weight", 0.5), f"{where} untargeted_weight", zero=True),
                             frozenset(fold(t) for t in _strings(raw, "targets", where)))


def _checked_term(term: str, where: str) -> str:
    """A term needs a letter or digit: "*" alone (any ending of nothing) would match every word."""
    if not any(c.isalnum() for c in term):
        raise ValueError(f"{where}: the term {term!r} has no letter or digit (a term is words)")
    return term


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
    """Compile each alone first, so a mistake is reported with the pattern it is in. One that
    matches the empty text ("", "a|", "x*") is refused: a category's patterns are searched as one
    regex, leftmost first, so it would match at the start of every text, an empty match that
    counts as none, and the category's other patterns would never be reached."""
    for alternative in alternatives:
        try:
            compiled = re.compile(alternative)
        except re.error as exc:
            raise ValueError(f"{where}: bad pattern {alternative!r}: {exc}") from None
        if compiled.search("") is not None:
            raise ValueError(f"{where}: the pattern {alternative!r} matches the empty text: it must match some text")
