"""The safety classifiers on their own: folding, the policy file, the profanity model, the hold-back,
and precision / recall per category on the labeled samples in tests/data/.

The two samples:
* moderation_sample.jsonl (180 sentences, 86 of them ordinary text that looks risky) was written
  first and the policy (fairway/safety/policy.toml) written against it: a regression test for the
  policy and the folding. Floors: precision 0.9 and recall 0.8 in every category, just under what
  it measures (one miss per category is allowed; an edit that breaks a category fails).
* moderation_heldout.jsonl (72 sentences, 28 ordinary) was written after the policy and never used
  to tune it: what the policy does on phrasings it was not written for. Patterns are precise and
  miss what they do not list, so the floors are precision (0.8 in every category that flags
  anything; it measured 1.0) and no more than 1 false positive in its 28 ordinary sentences, and a
  low recall floor over all categories together (0.3; it measured 0.44, 32 of 73). Do not tune the policy on
  this file: it would stop measuring anything.
"""

from __future__ import annotations

import asyncio
import json
import time
import tomllib
from pathlib import Path

import pytest

from fairway.safety import (
    CATEGORIES,
    DEFAULT_POLICY,
    HoldBack,
    Moderator,
    Policy,
    PolicyClassifier,
    SafetySettings,
    make_moderator,
)
from fairway.safety.classifier import FastClassifier
from fairway.safety.normalize import fold, squeeze, unleet
from fairway.safety.profanity import ProfanityModel, available

DATA = Path(__file__).parent / "data"
needs_model = pytest.mark.skipif(not available(), reason="alt-profanity-check (the safety extra) not installed")


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def expanded(categories: list[str]) -> set[str]:
    return set(categories) | {c.partition("/")[0] for c in categories}


@pytest.fixture(scope="module")
def moderator() -> Moderator:
    return make_moderator(SafetySettings(profanity_model=available()))


@pytest.fixture(scope="module")
def policy() -> PolicyClassifier:
    return PolicyClassifier(Policy.load())


async def table(moderator: Moderator, rows: list[dict]) -> dict[str, tuple[int, int, int]]:
    """(true positives, false positives, false negatives) per category."""
    results = await moderator.moderate([r["text"] for r in rows])
    counts = {}
    for category in CATEGORIES:
        tp = fp = fn = 0
        for row, result in zip(rows, results, strict=True):
            want, got = category in expanded(row["categories"]), result.categories[category]
            tp += want and got
            fp += got and not want
            fn += want and not got
        counts[category] = (tp, fp, fn)
    return counts


def report(counts: dict[str, tuple[int, int, int]]) -> str:
    lines = [f"{'category':24s} precision recall  tp fp fn"]
    for category, (tp, fp, fn) in counts.items():
        p = tp / (tp + fp) if tp + fp else 1.0
        r = tp / (tp + fn) if tp + fn else 1.0
        lines.append(f"{category:24s} {p:9.2f} {r:6.2f} {tp:3d} {fp:2d} {fn:2d}")
    return "\n".join(lines)


# -- the samples ----------------------------------------------------------------------------------


def test_samples_are_labeled_with_known_categories() -> None:
    for name, least, ordinary in (("moderation_sample.jsonl", 150, 60), ("moderation_heldout.jsonl", 60, 20)):
        rows = load(name)
        assert len(rows) >= least
        assert sum(not r["categories"] for r in rows) >= ordinary  # the hard negatives
        for row in rows:
            assert set(row["categories"]) <= set(CATEGORIES), row
        labeled = set().union(*(expanded(r["categories"]) for r in rows))
        assert labeled == set(CATEGORIES), f"{name} lacks {set(CATEGORIES) - labeled}"


@needs_model
async def test_precision_and_recall_per_category_on_the_sample(moderator: Moderator) -> None:
    counts = await table(moderator, load("moderation_sample.jsonl"))
    print("\nmoderation_sample.jsonl\n" + report(counts))
    for category, (tp, fp, fn) in counts.items():
        assert tp / (tp + fp) >= 0.9, f"{category} precision\n{report(counts)}"
        assert tp / (tp + fn) >= 0.8, f"{category} recall\n{report(counts)}"


@needs_model
async def test_precision_on_held_out_sentences(moderator: Moderator) -> None:
    rows = load("moderation_heldout.jsonl")
    counts = await table(moderator, rows)
    print("\nmoderation_heldout.jsonl\n" + report(counts))
    for category, (tp, fp, _) in counts.items():
        if tp + fp:
            assert tp / (tp + fp) >= 0.8, f"{category} precision\n{report(counts)}"
    results = await moderator.moderate([r["text"] for r in rows if not r["categories"]])
    assert sum(r.flagged for r in results) <= 1
    tp = sum(c[0] for c in counts.values())
    fn = sum(c[2] for c in counts.values())
    assert tp / (tp + fn) >= 0.3, report(counts)


# -- folding and the policy -----------------------------------------------------------------------


@pytest.mark.parametrize("tricked", [
    "K I L L yourself", "k.i.l.l yourself", "k-i-l-l y-o-u-r-s-e-l-f", "kill   yourself", "KiLL YoUrSeLf",
    "k1ll y0urs3lf", "k!ll yourself", "ki11 yourself", "kiiiill yourself", "killyourself",
    "kіll yоurself",  # Cyrillic і and о
    "ｋｉｌｌ ｙｏｕｒｓｅｌｆ",  # fullwidth
    "𝐤𝐢𝐥𝐥 𝐲𝐨𝐮𝐫𝐬𝐞𝐥𝐟",  # mathematical bold
    "k\u200bill your\u00adself",  # zero-width space, soft hyphen
    "kíll yóurself",  # accents
    "k̷i̷l̷l̷ yourself",  # combining overlays
])
def test_spelling_tricks_do_not_get_past_a_term(policy: PolicyClassifier, tricked: str) -> None:
    assert policy.matches(tricked)["harassment/threatening"], fold(tricked)


@pytest.mark.parametrize("ordinary", [
    "How do I kill a Python process?", "skill yourself up", "I killed yourself off in the story, sorry Bob",
    "Scunthorpe", "the assassin's creed", "grape juice", "a b c", "Plan A, B and C",
])
def test_word_boundaries_keep_ordinary_text_apart(policy: PolicyClassifier, ordinary: str) -> None:
    assert not any(policy.matches(ordinary).values()), policy.matches(ordinary)


# Runs that two neighbouring parts of a term (or the l33t reading) can each take: before the terms'
# runs were bounded, each of these took minutes to hours at this length (quadratic or cubic).
RUNS = ["kil" + "|" * 20_000 + "x", "1" * 100_000, "kil" + "l|" * 20_000 + "x", "i want to " + "*-" * 20_000,
        "y" + "0" * 50_000 + "u", "s$" * 20_000, "one " + "e" * 50_000 + "ye", "go" + " -" * 20_000 + "die"]


@pytest.mark.parametrize("text", RUNS, ids=[f"{r[:5]!r}..." for r in RUNS])
def test_a_long_run_is_checked_in_linear_time(policy: PolicyClassifier, text: str) -> None:
    """A request body may be 1 MiB: no run in it may make the policy's regexes backtrack for long.
    Each of these 40-100k character texts is matched in well under a second (10 s allows for a
    loaded machine; before, the first took ~10 minutes)."""
    started = time.perf_counter()
    policy.matches(text)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("stretched", ["kiiiiiiiiiiiiill yourself", "kill            yourself",
                                       "killlllllllllll yourself", "k!!!!!!!!ll yourself"])
def test_a_stretched_term_still_matches(policy: PolicyClassifier, stretched: str) -> None:
    assert policy.matches(stretched)["harassment/threatening"], stretched


def test_fold_and_unleet() -> None:
    assert fold("Ｋ I L L") == "kill"
    assert fold("ѕtrаnge") == "strange"  # Cyrillic ѕ, а
    assert fold("Straße") == "strasse"
    assert unleet(fold("$h1t h3@d")) == "shit head"
    assert unleet("k" + "1" * 10 + " " + "1" * 10) == "k" + "i" * 10 + " " + "1" * 10  # a number stays
    assert squeeze("kiiiiill |||||||||| 1!1!1!1!1!") == "kiiill ||| 1!1!1!"


def test_patterns_also_see_l33t_read_as_letters(policy: PolicyClassifier) -> None:
    assert policy.matches("h0w d0 1 m@ke a p1pe b0mb")["illicit/violent"]


def test_policy_file_mistakes_are_named(tmp_path: Path) -> None:
    good = (Path(__file__).parents[1] / "fairway" / "safety" / "policy.toml").read_text()
    bad = tmp_path / "policy.toml"
    bad.write_text(good.replace('"violence" = 0.5\n', ""))
    with pytest.raises(ValueError, match="no value for violence"):
        Policy.load(bad)
    bad.write_text(good + '\n[categories."violence/graphic2"]\nterms = ["x"]\n')
    with pytest.raises(ValueError, match="violence/graphic2"):
        Policy.load(bad)
    thresholds = {c: 0.5 for c in CATEGORIES}
    with pytest.raises(ValueError, match="violence\"\\] patterns: bad pattern '\\(unclosed'"):
        Policy.from_dict({"thresholds": thresholds, "categories": {"violence": {"patterns": ["(unclosed"]}}})
    with pytest.raises(ValueError, match="no list named 'nouns'"):
        Policy.from_dict({"thresholds": thresholds, "categories": {"hate": {"patterns": ["{nouns}"]}}})
    with pytest.raises(ValueError, match="cannot read"):
        Policy.load(tmp_path / "missing.toml")


@pytest.mark.parametrize("edit,named", [
    # a string where a list belongs was read a character at a time: "a|b" made "|", matching every text
    ({"categories": {"hate": {"patterns": "ab|c"}}}, 'hate"]: patterns must be a list of strings'),
    ({"categories": {"hate": {"terms": "abc"}}}, 'hate"]: terms must be a list of strings'),
    ({"categories": {"hate": {"patterns": [""]}}}, "matches the empty text"),
    ({"categories": {"hate": {"terms": ["*"]}}}, "has no letter or digit"),
    # a misspelt key was ignored: its words never matched
    ({"categories": {"hate": {"term": ["x"]}}}, "unknown key 'term'"),
    ({"treshold": {}}, "unknown key 'treshold'"),
    # the wrong shapes were AttributeError / TypeError tracebacks from `fairway serve`
    ({"categories": ["hate"]}, r"\[categories\] must be a table"),
    ({"categories": {"hate": "x"}}, "must be a table of terms and patterns"),
    ({"thresholds": {"hate": "high"}}, r"\[thresholds\] hate must be a number"),
    ({"thresholds": {"hate": True}}, r"\[thresholds\] hate must be a number"),
    ({"profanity": {"untargeted_weight": 5}}, "untargeted_weight must be a number in \\[0, 1\\]"),
    ({"profanity": {"targets": "you"}}, "targets must be a list of strings"),
    ({"lists": {"nouns": 5}}, r"\[lists\] nouns must be a string"),
])
def test_a_malformed_policy_is_refused_naming_the_place(edit: dict, named: str) -> None:
    data = tomllib.loads(DEFAULT_POLICY.read_text())
    for key, value in edit.items():
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) and isinstance(value, dict) else value
    with pytest.raises(ValueError, match=named) as info:
        Policy.from_dict(data, "ops.toml")
    assert str(info.value).startswith("ops.toml: ")


def test_an_operator_edit_takes_effect(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "fairway" / "safety" / "policy.toml").read_text()
    edited = tmp_path / "policy.toml"
    edited.write_text(text.replace('terms = ["porn",', 'terms = ["pineapple pizza", "porn",'))
    assert PolicyClassifier(Policy.load(edited)).matches("I ordered a PINEAPPLE   p1zza.")["sexual"]


# -- the moderator --------------------------------------------------------------------------------


class Fixed(FastClassifier):
    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def score(self, text: str) -> dict[str, float]:
        return dict(self.scores)


async def test_moderator_takes_the_highest_score_and_counts_it_for_the_parent() -> None:
    thresholds = {c: 0.5 for c in CATEGORIES}
    moderator = Moderator([Fixed({"self-harm/intent": 0.7}), Fixed({"self-harm/intent": 0.2, "hate": 0.4})],
                          thresholds)
    result = await moderator.moderate_one("x")
    assert result.flagged
    assert result.flagged_categories == ["self-harm", "self-harm/intent"]
    assert result.category_scores["hate"] == 0.4 and not result.categories["hate"]
    shaped = result.to_openai()
    assert set(shaped["categories"]) == set(CATEGORIES) == set(shaped["category_scores"])
    assert shaped["category_applied_input_types"]["self-harm"] == ["text"]
    assert not (await Moderator([Fixed({"hate": 0.4})], {**thresholds, "hate": 0.45}).moderate_one("x")).flagged


@needs_model
async def test_threshold_overrides_from_the_settings() -> None:
    strict = make_moderator(SafetySettings(thresholds={"harassment": 0.3}))
    lax = make_moderator(SafetySettings())
    text = "you killed it on stage"  # the model gives it ~0.33
    assert (await strict.moderate_one(text)).categories["harassment"]
    assert not (await lax.moderate_one(text)).flagged


@needs_model
def test_the_folded_profanity_model_matches_the_package() -> None:
    import profanity_check

    texts = [r["text"] for r in load("moderation_sample.jsonl")] + ["", "!!!", "you fucking idiot"]
    expected = profanity_check.predict_prob(texts)
    model = ProfanityModel()
    assert [round(model.probability(t), 9) for t in texts] == [round(float(p), 9) for p in expected]


@needs_model
async def test_swearing_at_nobody_is_not_harassment(moderator: Moderator) -> None:
    assert not (await moderator.moderate_one("Holy shit, the build finally passed.")).flagged
    assert (await moderator.moderate_one("Shut up, you worthless sack.")).categories["harassment"]


async def test_a_long_text_is_checked_while_the_event_loop_goes_on(moderator: Moderator) -> None:
    """A long message (the gateway takes bodies of up to 1 MiB) is checked without holding the loop: the
    streams the process relays meanwhile keep flowing. Scored inline, a ticker here would not run
    once until the check ended."""
    text = "A quiet paragraph about gardens, rivers and the weather in spring. " * 3_000 + "Go kill yourself."
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    result = await moderator.moderate_one(text, "input")
    took = time.perf_counter() - started
    ticker.cancel()
    assert result.categories["harassment/threatening"]  # the words at its very end were read
    assert took > 0.05 and ticks >= 3, f"the loop ran {ticks} times in the {took:.2f} s check"
    short = await moderator.moderate_one("Go kill yourself.", "input")  # (inline: same verdict)
    assert short.flagged_categories == result.flagged_categories


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="output_mode"):
        SafetySettings(output_mode="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown moderation category"):
        SafetySettings(thresholds={"rudeness": 0.5})


# -- the hold-back ----------------------------------------------------------------------------------


def tokens(text: str) -> list[str]:
    """Roughly how a BPE tokenizer cuts text: a word with the space before it, punctuation alone."""
    out: list[str] = []
    for part in text.replace(".", " .").replace("\n", " \n").split(" "):
        out.append(part if part in (".", "\n") or not out else " " + part)
    return [t for t in out if t.strip(" ")]


async def feed(hold: HoldBack, text: str) -> tuple[list[list[str]], object]:
    released: list[list[str]] = []
    for token in tokens(text):
        checked = await hold.push(token, token)
        released.append(checked.release)
        if checked.flagged:
            return released, checked.flagged
    checked = await hold.finish()
    released.append(checked.release)
    return released, checked.flagged


async def test_check_then_release_holds_each_sentence_until_it_is_checked(moderator: Moderator) -> None:
    released, flagged = await feed(HoldBack(moderator), "Here is a plan. It has two steps. And no end")
    assert flagged is None
    assert [r for r in released if r] == [["Here", " is", " a", " plan", "."], [" It", " has", " two", " steps", "."],
                                          [" And", " no", " end"]]
    assert all(not r for r in released[:4])  # nothing out before the sentence ends


async def test_a_flagged_sentence_is_dropped_and_what_came_before_kept(moderator: Moderator) -> None:
    released, flagged = await feed(HoldBack(moderator), "Sure. Here is how to make a pipe bomb at home. Step one")
    assert flagged is not None and flagged.flagged_categories == ["illicit", "illicit/violent"]
    assert sum(released, []) == ["Sure", "."]


async def test_release_then_check_streams_at_once_and_stops_after_the_sentence(moderator: Moderator) -> None:
    released, flagged = await feed(HoldBack(moderator, "release-then-check"), "Sure. How to make a pipe bomb. More")
    assert all(len(r) == 1 for r in released)  # every token out as it came
    assert flagged is not None and "".join(sum(released, [])) == "Sure. How to make a pipe bomb."


async def test_a_sentence_without_an_end_is_checked_at_the_length_bound(moderator: Moderator) -> None:
    hold = HoldBack(moderator, max_sentence_chars=20)
    first = [await hold.push(t, t) for t in ["aaaa ", "bbbb ", "cccc ", "dddd ", "eeee ", "ffff "]]
    assert [len(c.release) for c in first] == [0, 0, 0, 4, 0, 0]
    assert hold.held == 2


async def test_a_phrase_cut_by_sentence_ends_is_judged_whole(moderator: Moderator) -> None:
    """The input check folds "k.i.l.l yourself" into the words it spells; each "." also ends a
    sentence, and the output check judged the pieces alone: every one passed."""
    from prometheus_client import REGISTRY

    def counted() -> float:
        labels = {"stage": "output", "category": "harassment/threatening"}
        return REGISTRY.get_sample_value("fairway:safety_flagged_total", labels) or 0.0

    before = counted()
    hold = HoldBack(moderator)
    released: list[str] = []
    for token in ["Sure", ".", " k", ".", "i", ".", "l", ".", "l", " yourself", "."]:
        checked = await hold.push(token, token)
        released += checked.release
        if checked.flagged:
            break
    assert checked.flagged is not None and checked.flagged.categories["harassment/threatening"]
    assert "".join(released) == "Sure. k.i.l."  # the piece that completes it is never released
    assert counted() == before + 1  # one sentence, one count (it was judged alone and with those before)
