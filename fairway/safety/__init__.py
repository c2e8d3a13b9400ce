"""Safety: the classifiers behind one interface, on the user's new message before routing and
on the reply, sentence by sentence, where its tokens enter the token log.

* classifier.py: Classifier (text in, scores per category out) and the Moderator that combines
  classifiers into an OpenAI-shaped ModerationResult (result.py) against per-category thresholds;
* policy.py + policy.toml: per-category terms and patterns operators edit, matched after
  normalize.py's folding (Unicode, case, homoglyphs, spacing, l33t);
* profanity.py: alt-profanity-check's trained model (the `safety` extra);
* holdback.py: one reply's output check (hold the current sentence until it is checked).

make_moderator() builds the default chain: the policy, plus the profanity model when enabled.
A heavier classifier (a Llama Guard-style model run through the engine) joins the chain as one
more Classifier.
"""

from __future__ import annotations

from fairway.safety.categories import CATEGORIES, Scores
from fairway.safety.classifier import Classifier, FastClassifier, Moderator, Stage
from fairway.safety.config import OUTPUT_MODES, OutputMode, SafetySettings
from fairway.safety.holdback import Checked, HoldBack
from fairway.safety.policy import DEFAULT_POLICY, Policy, PolicyClassifier
from fairway.safety.result import ModerationResult


def make_moderator(settings: SafetySettings | None = None) -> Moderator:
    """The moderator for these settings; ValueError for a bad policy file, or when the profanity
    model is asked for but not installed."""
    settings = settings or SafetySettings()
    policy = Policy.load(settings.policy_path)
    classifiers: list[Classifier] = [PolicyClassifier(policy)]
    if settings.profanity_model:
        from fairway.safety.profanity import ProfanityClassifier

        classifiers.append(ProfanityClassifier(policy.profanity))
    return Moderator(classifiers, {**policy.thresholds, **settings.thresholds})


__all__ = [
    "CATEGORIES",
    "DEFAULT_POLICY",
    "OUTPUT_MODES",
    "Checked",
    "Classifier",
    "FastClassifier",
    "HoldBack",
    "ModerationResult",
    "Moderator",
    "OutputMode",
    "Policy",
    "PolicyClassifier",
    "SafetySettings",
    "Scores",
    "Stage",
    "make_moderator",
]
