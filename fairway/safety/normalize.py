"""Text folded for matching, so that spelling tricks do not get past the policy's patterns.

fold() applies, in order:
* NFKC: fullwidth letters, mathematical alphanumerics (𝐤𝐢𝐥𝐥), circled and superscript letters,
  ligatures become plain ones;
* invisible characters (zero-width spaces and joiners, soft hyphens, bidi controls: Unicode
  category Cf) and combining marks (accents, "zalgo" stacks) are dropped;
* case folding, then homoglyphs: Cyrillic and Greek letters that look like Latin ones, and a
  few Latin lookalikes (ı, ł, ø), become those Latin letters;
* letters spelled out with separators ("k i l l", "k.i.l.l", "k-i-l-l") are joined into a word.

L33t digits and symbols (k1ll, $hit, @ss) are left in place: the policy matches each letter
of a term against its l33t forms (policy.py), and its regexes also run on unleet()'s view.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# Lowercase forms only: fold() case-folds first. Each maps to the Latin letter it is drawn like.
_HOMOGLYPHS = {
    # Cyrillic
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p",
    "с": "c", "т": "t", "у": "y", "х": "x", "ѕ": "s", "і": "i", "ї": "i", "ј": "j", "ԁ": "d",
    "ԛ": "q", "ԝ": "w", "һ": "h", "ү": "y", "ӏ": "l", "ɡ": "g", "ь": "b", "п": "n", "г": "r",
    # Greek
    "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p",
    "τ": "t", "υ": "u", "χ": "x", "ω": "w", "μ": "u", "ϲ": "c", "ϳ": "j",
    # Latin lookalikes
    "’": "'", "‘": "'", "ʼ": "'",
    "ı": "i", "ł": "l", "ø": "o", "đ": "d", "ħ": "h", "ŧ": "t", "ß": "ss", "ſ": "s", "ɑ": "a", "ɩ": "i",
}
_HOMOGLYPH_TABLE = str.maketrans(_HOMOGLYPHS)

# L33t symbols, each read as the letter it most often stands for.
_LEET = {"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s", "|": "l", "€": "e"}
_LEET_TABLE = str.maketrans(_LEET)
# Only inside a word, next to a letter: "k1ll", "$hit", not "7-year-old" or "2000". A run is tried
# from its start only: tried from each of its characters, a long run of digits took quadratic time.
_LEET_IN_WORD = re.compile(r"(?<=[^\W\d_])[013457@$|€]+|(?<![013457@$|€])[013457@$|€]++(?=[^\W\d_])")

# A run of at least three single letters (or l33t symbols), each standing alone between
# separators: spelled out to dodge a word list. Ordinary text rarely has three in a row.
_CH = r"(?:[^\W_]|[@$|])"
_SPACED = re.compile(rf"(?<![^\W_])(?<![@$|]){_CH}(?:[\s.\-_~·•,/\\]+{_CH}(?![^\W_])(?![@$|])){{2,}}")
_SEPARATORS = re.compile(r"[\s.\-_~·•,/\\]+")
_DROPPED_CATEGORIES = frozenset({"Cf", "Mn", "Me"})


def fold(text: str) -> str:
    """The text as the policy matches it. Sentence-sized texts are cached: every classifier of a
    check folds the same one (a long text is folded afresh, so the cache stays small)."""
    return _fold_cached(text) if len(text) <= 1024 else _fold(text)


@lru_cache(maxsize=4096)
def _fold_cached(text: str) -> str:
    return _fold(text)


def _fold(text: str) -> str:
    if text.isascii():
        folded = text.casefold()
    else:
        decomposed = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        kept = "".join(c for c in decomposed if unicodedata.category(c) not in _DROPPED_CATEGORIES)
        folded = unicodedata.normalize("NFC", kept).casefold().translate(_HOMOGLYPH_TABLE)
    return _SPACED.sub(lambda m: _SEPARATORS.sub("", m.group()), folded)


def unleet(folded: str) -> str:
    """A folded text with its l33t symbols read as letters where they touch letters: the view the
    policy's regexes also see. Numbers stay numbers ("a 12 year old")."""
    return _LEET_IN_WORD.sub(lambda m: m.group().translate(_LEET_TABLE), folded)


LEET_FORMS: dict[str, str] = {}  # letter -> the characters that may stand for it (itself included)
for _symbol, _letter in _LEET.items():
    LEET_FORMS[_letter] = LEET_FORMS.get(_letter, _letter) + _symbol
for _vowel in "aeiou":  # a masked vowel: f*ck, sh!t
    LEET_FORMS[_vowel] = LEET_FORMS.get(_vowel, _vowel) + "*"
LEET_FORMS["i"] += "!"
LEET_FORMS["l"] += "1"
LEET_FORMS["t"] += "+"


# The view a policy's terms are matched in: a term's letters are each one or more of their forms,
# so where two neighbours can take the same characters (a letter run "llll", the l33t symbols two
# letters share or a letter shares with the separators between words: 1 for i and l, * for the
# vowels, | $ @ ...) a backtracking regex tries every split of a run: a few thousand such
# characters took minutes. No word spells a letter with more than three of the same character,
# nor more than six of those symbols in a row: longer runs are cut to that, and every split is short.
_SAME_RUN = re.compile(r"(.)\1{3,}", re.DOTALL)
_SHARED = sorted({c for forms in LEET_FORMS.values() for c in forms if not c.isalpha()
                  and (not (c.isalnum() or c == "_") or sum(c in f for f in LEET_FORMS.values()) > 1)})
_SHARED_RUN = re.compile("[" + "".join(re.escape(c) for c in _SHARED) + "]{7,}")


def squeeze(folded: str) -> str:
    """A folded text with runs of one character cut to three and runs of shared l33t symbols to six."""
    return _SHARED_RUN.sub(lambda m: m.group()[:6], _SAME_RUN.sub(lambda m: m.group(1) * 3, folded))
