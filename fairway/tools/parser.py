"""Tool calls in the model's output, parsed as it streams.

Two forms: the seed's `<tool_call name="execute_code">print(1)</tool_call>` (the body is the
code for execute_code, a JSON object of arguments for any other tool) and the common JSON-in-tags
`<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`.

Text is released as soon as it cannot be the start of a call. From a possible opening tag on it is
buffered, and a call is parsed only once it is whole: a client never sees a half-parsed call as
text (a known failure of streaming parsers that emit the tag's first characters).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fairway.tools.spec import EXECUTE_CODE

OPEN = "<tool_call"
CLOSE = "</tool_call>"
_HEADER = re.compile(r"""^\s*(?:name\s*=\s*(?:"([^"]*)"|'([^']*)'))?\s*$""")
_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.S)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text ("{}" when it had none)
    raw: str  # the block as the model wrote it
    error: str | None = None  # why it is not a usable call (the model is told so)


class CallParser:
    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False

    @property
    def buffering(self) -> bool:
        """Inside a call, or holding what may be the start of one."""
        return self._in_call or bool(self._pending)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """More output: the text to release now (in order, the text before each call joined) and
        the calls completed by it."""
        self._pending += text
        released: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if not self._in_call:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._pending, OPEN)
                    released.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                after = self._pending[at + len(OPEN): at + len(OPEN) + 1]
                if after == "":
                    released.append(self._pending[:at])
                    self._pending = self._pending[at:]
                    break
                if after not in "> \t\n":  # "<tool_calls", "<tool_caller": not our tag
                    released.append(self._pending[: at + len(OPEN)])
                    self._pending = self._pending[at + len(OPEN):]
                    continue
                released.append(self._pending[:at])
                self._pending = self._pending[at:]
                self._in_call = True
            end = self._pending.find(CLOSE)
            if end < 0:
                break
            block, self._pending = self._pending[: end + len(CLOSE)], self._pending[end + len(CLOSE):]
            self._in_call = False
            calls.append(parse_block(block))
        return "".join(released), calls

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """At the end of the output: an unclosed call that parses whole counts (a model may stop
        right after its arguments); one that does not is dropped, never released as text (a
        half-written call is markup, not an answer: it would be shown, stored, and put in the next
        prompt). What may begin a tag ("<tool_") is text where the model stopped, and dropped where
        the output was cut (max_tokens: it was on its way to a call)."""
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            call = parse_block(pending + CLOSE)
            return ("", [call]) if call.error is None else ("", [])
        return ("" if cut else pending), []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins the tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def parse_block(block: str) -> ParsedCall:
    """One whole `<tool_call ...>...</tool_call>` block."""
    inner = block[len(OPEN): -len(CLOSE)]
    header, sep, body = inner.partition(">")
    if not sep:
        return ParsedCall("", "{}", block, "the tool call's opening tag is not closed with '>'")
    named = _HEADER.match(header)
    if named is None:
        return ParsedCall("", "{}", block, f"unreadable tool call tag {header.strip()!r}: use name=\"...\"")
    name = named.group(1) or named.group(2)
    if name is not None:
        return _named(name, body, block)
    return _json_call(body, block)


def _named(name: str, body: str, block: str) -> ParsedCall:
    """The seed's form: the body is the code (execute_code) or the arguments as JSON."""
    text = body.strip()
    if name == EXECUTE_CODE:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("code"), str):
            return ParsedCall(name, json.dumps(value, ensure_ascii=False), block)
        return ParsedCall(name, json.dumps({"code": strip_fence(body)}, ensure_ascii=False), block)
    if not text:
        return ParsedCall(name, "{}", block)
    return _arguments(name, text, block)


def _json_call(body: str, block: str) -> ParsedCall:
    """The JSON-in-tags form: {"name": ..., "arguments": {...}} ("parameters" also seen)."""
    try:
        value = json.loads(strip_fence(body))
    except json.JSONDecodeError as exc:
        return ParsedCall("", "{}", block, f"the tool call is not JSON: {exc}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ParsedCall("", "{}", block, 'a tool call must be {"name": ..., "arguments": {...}}')
    name = value["name"]
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return _arguments(name, arguments, block)
    if not isinstance(arguments, dict):
        return ParsedCall(name, "{}", block, "the tool call's arguments must be a JSON object")
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), block)


def _arguments(name: str, text: str, block: str) -> ParsedCall:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return ParsedCall(name, "{}", block, f"the arguments of {name} are not JSON: {exc}")
    if not isinstance(value, dict):
        return ParsedCall(name, "{}", block, f"the arguments of {name} must be a JSON object")
    return ParsedCall(name, json.dumps(value, ensure_ascii=False), block)


def strip_fence(body: str) -> str:
    """Code as models write it: maybe in a ``` fence, with the blank lines around it dropped."""
    fenced = _FENCE.match(body)
    text = fenced.group(1) if fenced else body
    return text.strip("\n")
