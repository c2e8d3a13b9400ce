"""Tool results answer calls, as OpenAI requires: each `tool` message answers a call that is still
waiting for its result, once ("messages with role 'tool' must be a response to a preceding message
with 'tool_calls'"), and every call gets its result before the conversation moves on ("An
assistant message with 'tool_calls' must be followed by tool messages responding to each
'tool_call_id'"). A result for no call, or a second one, would be stored and put in every later
prompt as if the model had asked for it; a call without a result would be put there as a call the
model made and never heard back from (it makes one up).

A call waits from the assistant message that made it until its result; a user or assistant message
while one still waits, or the request's end, is a 400. In a request that continues a stored
conversation, the calls of the conversation's last assistant message that have no result yet
(`waiting_calls`) wait the same way: the request's tool messages before any message of its own
answer them, all of them (as OpenAI's Responses API refuses a new input while a call of the
previous response has no output)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fairway.tools.spec import ToolError

ChatMessage = Mapping[str, Any]


def check_results(messages: Sequence[ChatMessage], waiting: Iterable[str] | None = ()) -> None:
    """Raise ToolError for a tool message that answers no waiting call (naming its
    `messages[i].tool_call_id`) and for calls left without a result when a user or assistant
    message comes (naming its `messages[i].role`) or the messages end (naming the calls'
    `messages[i].tool_calls`, or `messages` for stored calls). `waiting`: the stored
    conversation's calls still waiting for a result; None when they are not known here (the
    leading tool messages are then left to the caller that knows them)."""
    open_calls = None if waiting is None else list(waiting)
    made_at: int | None = None  # the request's message that made the open calls; None: the store's
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "assistant"):  # the conversation moves on: every waiting call needs its result
            _check_answered(open_calls, made_at, f"messages[{i}].role")
            open_calls, made_at = [call["id"] for call in message.get("tool_calls") or ()], i
        elif role == "tool" and open_calls is not None:
            call_id = message.get("tool_call_id", "")
            if call_id not in open_calls:
                raise ToolError(f"Invalid 'messages[{i}].tool_call_id' {call_id!r}: messages with role 'tool' must "
                                "be a response to a preceding message with 'tool_calls', one result per call "
                                "(this call id is unknown or already answered).", f"messages[{i}].tool_call_id")
            open_calls.remove(call_id)
    _check_answered(open_calls, made_at, "messages" if made_at is None else f"messages[{made_at}].tool_calls")


def _check_answered(open_calls: list[str] | None, made_at: int | None, param: str) -> None:
    """OpenAI's 400 for calls still without a result where the conversation moves on or ends."""
    if not open_calls:
        return
    stored = ("" if made_at is not None else ". They are calls of the conversation's last reply: send a tool "
              "message for each before the next message")
    raise ToolError("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                    "'tool_call_id'. The following tool_call_ids did not have response messages: "
                    f"{', '.join(open_calls)}{stored}", param)


def waiting_calls(stored: Sequence[tuple[str, Mapping[str, Any] | None]]) -> list[str]:
    """The ids of the client calls of a stored conversation's last assistant message that have
    no result yet; `stored` is its messages in order, as (role, tools column) pairs (a stored
    assistant message keeps its calls in tools["calls"], the client's with status "call"; a tool
    message keeps the call it answers in tools["tool_call_id"])."""
    waiting: list[str] = []
    for role, tools in stored:
        tools = tools or {}
        if role in ("user", "assistant"):
            waiting = [c["id"] for c in tools.get("calls", ()) if c.get("status") == "call"]
        elif role == "tool" and tools.get("tool_call_id") in waiting:
            waiting.remove(tools["tool_call_id"])
    return waiting
