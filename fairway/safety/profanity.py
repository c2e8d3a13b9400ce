"""alt-profanity-check's model (a linear SVM on TF-IDF words, trained on abusive language), run
without scikit-learn.

The wheel ships the fitted scikit-learn objects: a TfidfVectorizer and a CalibratedClassifierCV
of five LinearSVCs with sigmoid calibration. Through scikit-learn one sentence costs far more
than its arithmetic, nearly all per-call overhead (bench/README.md, safety.py); the model itself is
five dot products over a sentence's few words. So the
fitted objects are read once and folded into one table, word -> (idf, the five SVMs' weights),
and a sentence is scored with exactly the same arithmetic (tests/test_safety.py compares the two).

Installed with the `safety` extra (it brings scikit-learn to unpickle the model).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from fairway.cache_dir import cache_dir
from fairway.safety.categories import Scores
from fairway.safety.classifier import FastClassifier
from fairway.safety.normalize import fold
from fairway.safety.policy import ProfanitySettings

INSTALL_HINT = "pip install 'fairway[safety]' (alt-profanity-check), or turn the model off (--no-profanity-model)"
_WORD = re.compile(r"(?u)\b\w+\b")
_MODEL_FILES = ("vectorizer.joblib", "model.joblib")


def available() -> bool:
    return importlib.util.find_spec("profanity_check") is not None


class ProfanityModel:
    """The folded model: probability(abusive) of a text, as profanity_check.predict_prob gives it.

    The folded table is cached (FAIRWAY_CACHE_DIR, keyed by the model files' hash), so only the
    first start pays for importing scikit-learn and unpickling."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("profanity_check")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"alt-profanity-check is not installed: {INSTALL_HINT}")
        data = Path(list(spec.submodule_search_locations)[0]) / "data"
        digest = hashlib.sha256(b"".join((data / f).read_bytes() for f in _MODEL_FILES)).hexdigest()[:16]
        cached = cache_dir() / "safety" / f"profanity-{digest}.json"
        try:
            folded = json.loads(cached.read_text())
        except (OSError, ValueError):
            folded = _fold_fitted()
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(folded))
            partial.replace(cached)  # atomic: a concurrent start reads the old or the whole new
        self._token = re.compile(folded["token_pattern"])
        self._stop = frozenset(folded["stop_words"])
        self._intercepts = folded["intercepts"]
        self._calibration = [tuple(ab) for ab in folded["calibration"]]
        self._table = {word: (idf, tuple(weights)) for word, (idf, weights) in folded["table"].items()}

    def probability(self, text: str) -> float:
        counts = Counter(w for w in self._token.findall(text.lower()) if w not in self._stop)
        weights = [(count * entry[0], entry[1]) for word, count in counts.items()
                   if (entry := self._table.get(word)) is not None]
        norm = math.sqrt(sum(x * x for x, _ in weights)) or 1.0
        total = 0.0
        for i, (intercept, (a, b)) in enumerate(zip(self._intercepts, self._calibration, strict=True)):
            decision = intercept + sum(x * w[i] for x, w in weights) / norm
            total += _expit(-(a * decision + b))
        return total / len(self._intercepts)


def _fold_fitted() -> dict[str, Any]:
    """The fitted vectorizer and calibrated SVMs as plain numbers (imports scikit-learn)."""
    from profanity_check import profanity_check as fitted

    vectorizer, model = fitted.vectorizer, fitted.model
    if vectorizer.norm != "l2" or vectorizer.sublinear_tf or vectorizer.ngram_range != (1, 1):
        raise RuntimeError("alt-profanity-check's vectorizer changed shape; use the pinned version")
    calibrated = model.calibrated_classifiers_
    coefs = [c.estimator.coef_[0] for c in calibrated]
    return {
        "token_pattern": vectorizer.token_pattern,
        "stop_words": sorted(vectorizer.get_stop_words() or ()),
        "intercepts": [float(c.estimator.intercept_[0]) for c in calibrated],
        "calibration": [(float(c.calibrators[0].a_), float(c.calibrators[0].b_)) for c in calibrated],
        "table": {word: (float(vectorizer.idf_[j]), [float(c[j]) for c in coefs])
                  for word, j in vectorizer.vocabulary_.items()},
    }


class ProfanityClassifier(FastClassifier):
    """The model's probability as a score in one category (harassment by default); a text with
    none of the policy's target words ("you", "he", ...) gets untargeted_weight of it: swearing
    at nobody is not harassment."""

    name = "profanity"

    def __init__(self, settings: ProfanitySettings, model: ProfanityModel | None = None) -> None:
        self.settings = settings
        self.model = model or ProfanityModel()

    def score(self, text: str) -> Scores:
        folded = fold(text)
        p = self.model.probability(folded)
        if not any(w in self.settings.targets for w in _WORD.findall(folded)):
            p *= self.settings.untargeted_weight
        return {self.settings.category: p}


def _expit(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
