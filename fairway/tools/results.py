"""Tool results answer calls: each `tool` message answers a call that is still waiting for its
result, once, as OpenAI requires ("messages with role 'tool' must be a response to a preceding
message with 'tool_calls'"). A result for no call, or a second one for the same call, would be
stored and put in every later prompt as if the model had asked for it.

A call waits from the assistant message that made it until the conversation moves on (a user or
assistant message). In a request that continues a stored conversation, the tool messages before
any message of its own answer the calls of the conversation's last assistant message that have
no result yet (`waiting_calls`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fairway.tools.spec import ToolError

ChatMessage = Mapping[str, Any]


def check_results(messages: Sequence[ChatMessage], waiting: Iterable[str] | None = ()) -> None:
    """Raise ToolError (naming `messages[i].tool_call_id`) for a tool message that answers no
    waiting call. `waiting`: the stored conversation's calls still waiting for a result; None
    when they are not known here (the leading tool messages are then left to the caller that
    knows them)."""
    open_calls = None if waiting is None else set(waiting)
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "assistant"):  # the conversation moved on: only this message's calls wait
            open_calls = {call["id"] for call in message.get("tool_calls") or ()}
        elif role == "tool" and open_calls is not None:
            call_id = message.get("tool_call_id", "")
            if call_id not in open_calls:
                raise ToolError(f"Invalid 'messages[{i}].tool_call_id' {call_id!r}: messages with role 'tool' must "
                                "be a response to a preceding message with 'tool_calls', one result per call "
                                "(this call id is unknown or already answered).", f"messages[{i}].tool_call_id")
            open_calls.discard(call_id)


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
