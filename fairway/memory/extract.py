"""Facts about the user, from a conversation: explicit statements taken deterministically, and
durable facts the model is asked for as JSON (validated, retried within a bound)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

ChatMessage = dict[str, Any]
# The model behind extraction: chat messages in, the reply's text out (a background-lane job).
Complete = Callable[[list[ChatMessage]], Awaitable[str]]


class ExtractionModel(Protocol):
    """Complete, and whether a replica serves it now (the idle pass waits for one rather than
    read messages it could only half extract)."""

    async def __call__(self, messages: list[ChatMessage]) -> str: ...

    async def ready(self) -> bool: ...

MAX_FACT_CHARS = 200
MAX_FACTS = 10  # per conversation and extraction

# "I'm allergic to peanuts" -> "User is allergic to peanuts". Each pattern is a statement a user
# makes about themselves; the rest of the clause (to . ! ? ; or a line end) is the fact's object.
# A clause also ends where another statement starts ("... and my name is ...", ", but I ...").
_CLAUSE = rf"(?P<rest>(?:(?!,? (?:and|but) (?:i|my|i'm)\b)[^.!?;\n]){{2,{MAX_FACT_CHARS}}})"
_EXPLICIT: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bmy name is\s+" + _CLAUSE, re.I), "User's name is {rest}"),
    (re.compile(r"\b(?:i am|i'm|im)\s+allergic to\s+" + _CLAUSE, re.I), "User is allergic to {rest}"),
    (re.compile(r"\bi have an? allergy to\s+" + _CLAUSE, re.I), "User is allergic to {rest}"),
    (re.compile(r"\bi (?:really )?prefer\s+" + _CLAUSE, re.I), "User prefers {rest}"),
    (re.compile(r"\bi (?:mostly |usually |always )?use\s+" + _CLAUSE, re.I), "User uses {rest}"),
    (re.compile(r"\bi (?:really )?(?:like|love)\s+" + _CLAUSE, re.I), "User likes {rest}"),
    (re.compile(r"\bi (?:really )?(?:dislike|hate)\s+" + _CLAUSE, re.I), "User dislikes {rest}"),
    (re.compile(r"\bi (?:am|'m) (?:a|an)\s+" + _CLAUSE, re.I), "User is a {rest}"),
    (re.compile(r"\bi live in\s+" + _CLAUSE, re.I), "User lives in {rest}"),
    (re.compile(r"\bi work (?:at|for)\s+" + _CLAUSE, re.I), "User works at {rest}"),
    (re.compile(r"\bi(?: am|'m) vegetarian\b", re.I), "User is vegetarian"),
    (re.compile(r"\bi(?: am|'m) vegan\b", re.I), "User is vegan"),
]
# A question or a hypothetical is no statement about the user, nor is a bare pronoun an object.
_NOT_A_STATEMENT = re.compile(r"\?\s*$|\b(?:if|whether|when|suppose|should|would|could|can)\b", re.I)
_PRONOUN = re.compile(r"^(?:it|this|that|these|those|them|you|him|her)\b", re.I)

EXTRACTION_PROMPT = (
    "You extract durable facts about the user from a conversation: their name, preferences, tools, "
    "allergies, diet, location, job, ongoing projects. Only facts the user stated about themselves that "
    "will still be true in later conversations; nothing about the assistant, nothing temporary, no "
    "guesses. Answer with JSON only, in exactly this shape: "
    '{"facts": ["User is allergic to peanuts.", "User prefers Python."]} '
    '- and {"facts": []} when there are none.'
)


def clean_fact(text: str) -> str | None:
    """One line, trimmed, bounded, ending in a full stop; None if nothing is left."""
    fact = " ".join(str(text).split()).strip(" -*•\"'")
    if len(fact) < 3:
        return None
    fact = fact[:MAX_FACT_CHARS].rstrip(" ,;:")
    return fact if fact.endswith((".", "!", "?")) else fact + "."


def explicit_facts(text: str) -> list[str]:
    """The user's explicit statements about themselves in one message, as facts."""
    found: list[str] = []
    for sentence in re.split(r"(?<=[.!?;\n])\s*", text):
        if not sentence or _NOT_A_STATEMENT.search(sentence):
            continue
        for pattern, template in _EXPLICIT:
            for match in pattern.finditer(sentence):
                rest = match.groupdict().get("rest")
                if rest and _PRONOUN.match(rest.strip()):
                    continue
                fact = clean_fact(template.format(rest=rest.strip()) if rest else template)
                if fact and fact not in found:
                    found.append(fact)
    return found


def parse_facts(reply: str) -> list[str]:
    """The facts of a model's answer: a JSON object {"facts": [str, ...]}, possibly wrapped in a
    code fence or surrounded by text. ValueError when there is no such object."""
    start, end = reply.find("{"), reply.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("no JSON object in the answer")
    data = json.loads(reply[start : end + 1])
    if not isinstance(data, dict) or not isinstance(data.get("facts"), list):
        raise ValueError('the answer is not {"facts": [...]}')
    if not all(isinstance(f, str) for f in data["facts"]):
        raise ValueError("every fact must be a string")
    return [f for f in (clean_fact(x) for x in data["facts"]) if f][:MAX_FACTS]


def transcript(messages: Sequence[tuple[str, str]], max_chars: int = 6000) -> str:
    """The conversation as "role: text" lines, the newest kept when it is too long."""
    lines = [f"{role}: {' '.join(text.split())}" for role, text in messages if role in ("user", "assistant")]
    out: list[str] = []
    size = 0
    for line in reversed(lines):
        if size + len(line) > max_chars:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(reversed(out))


async def model_facts(complete: Complete, messages: Sequence[tuple[str, str]], attempts: int = 3) -> list[str]:
    """Ask the model for the user's facts; a malformed answer is asked again (with what was wrong)
    up to `attempts` times in all, then given up on: [] (the explicit facts still count)."""
    chat: list[ChatMessage] = [{"role": "system", "content": EXTRACTION_PROMPT},
                               {"role": "user", "content": "Conversation:\n" + transcript(messages)}]
    for attempt in range(attempts):
        answer = await complete(chat)
        try:
            return parse_facts(answer)
        except ValueError as e:  # json.JSONDecodeError is one
            log.info("memory extraction answer %d of %d unusable: %s", attempt + 1, attempts, e)
            chat = [*chat, {"role": "assistant", "content": answer[:2000]},
                    {"role": "user", "content": f"That was not valid ({e}). Answer with the JSON object only."}]
    return []
