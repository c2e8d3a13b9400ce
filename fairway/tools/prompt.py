"""Tools in the prompt, for a chat template without tool support (SmolLM2's has none): a
documented system block, and the calls and results as text the model can follow.

The system block (after the conversation's own system text, so it stays in the cached prefix):

    # Tools
    You may call one or more functions to assist with the user query.
    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>
    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

plus, when execute_code is offered, how to run Python with it (the seed's form,
`<tool_call name="execute_code">code</tool_call>`). An assistant message's calls are rendered back
in the same forms, and a tool result as a user turn `<tool_response>...</tool_response>` (the
convention of Hermes- and Qwen-style templates), so a stored conversation renders as the model
saw it while it ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from fairway.tools.parser import CLOSE, OPEN
from fairway.tools.spec import EXECUTE_CODE, ToolSet

ChatMessage = dict[str, Any]
Render = Callable[..., str]  # a tokenizer's apply_chat_template(messages, add_generation_prompt=...)

_MARK = "\x00fairway-mark\x00"


def system_block(tools: ToolSet) -> str:
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.", "",
             "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    lines += [json.dumps(tool.to_openai(), ensure_ascii=False) for tool in tools.offered]
    lines += ["</tools>", "", "For each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:", "<tool_call>",
              '{"name": <function-name>, "arguments": <args-json-object>}', "</tool_call>"]
    if tools.code:
        lines += ["", "To run Python code, write it inside the tag, like this:",
                  f'{OPEN} name="{EXECUTE_CODE}">', "print(2 + 2)", CLOSE,
                  "Its output comes back inside <tool_response></tool_response> tags; then go on with your answer."]
    if not tools.parallel:
        lines += ["", "Call at most one function in your reply."]
    if tools.choice == "required":
        lines += ["", "You must call one of these functions now."]
    elif tools.choice == "function":
        lines += ["", f"You must call the function {tools.named} now."]
    return "\n".join(lines)


def render_call(name: str, arguments: str) -> str:
    """A call as the model is asked to write it."""
    if name == EXECUTE_CODE:
        try:
            code = json.loads(arguments).get("code")
        except (json.JSONDecodeError, AttributeError):
            code = None
        if isinstance(code, str):
            return f'{OPEN} name="{EXECUTE_CODE}">\n{code}\n{CLOSE}'
    try:
        args: Any = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        args = arguments
    return f"{OPEN}>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def plain_message(message: ChatMessage) -> ChatMessage:
    """One message in OpenAI's form (assistant tool_calls, tool results) as role and text only."""
    role = message["role"]
    if role == "tool":
        return {"role": "user", "content": tool_response(message.get("content") or "")}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        rendered = "\n".join(render_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        return {"role": "assistant", "content": (message.get("content") or "") + rendered}
    return {"role": role, "content": message.get("content") or ""}


def plain_messages(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Each message on its own (no message's text depends on another's, which keeps the context
    builder's per-message segments stable from turn to turn)."""
    return [plain_message(m) for m in messages]


def openai_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def expand_assistant(text: str, calls: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """A stored assistant message (its text and its calls, each at the text offset it was made)
    as the messages the model saw: each built-in round is a call and its result, then the text
    went on; the client's calls (status "call") end the last message."""
    out: list[ChatMessage] = []
    at = 0
    for call in calls:
        if call.get("status") == "call":
            continue
        cut = min(int(call.get("at", 0)), len(text))
        out.append({"role": "assistant", "content": text[at:cut],
                    "tool_calls": [openai_call(call["id"], call["name"], call.get("arguments", ""))]})
        out.append({"role": "tool", "tool_call_id": call["id"], "content": call.get("output", "")})
        at = max(at, cut)
    client = [openai_call(c["id"], c["name"], c.get("arguments", "")) for c in calls if c.get("status") == "call"]
    last: ChatMessage = {"role": "assistant", "content": text[at:]}
    if client:
        last["tool_calls"] = client
    out.append(last)
    return out


def native_message(message: ChatMessage) -> ChatMessage:
    """A message for a template that renders tools itself: as OpenAI sends it, with each call's
    arguments as an object (what Hugging Face templates expect)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    rendered = []
    for call in calls:
        try:
            arguments: Any = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = call["function"]["arguments"]
        rendered.append({**call, "function": {"name": call["function"]["name"], "arguments": arguments}})
    return {**message, "tool_calls": rendered}


def prompt_messages(messages: Sequence[ChatMessage], native: bool) -> list[ChatMessage]:
    """The messages as the template takes them: OpenAI's form for a template with tool support,
    plain text otherwise. Each message on its own (stable per-message segments)."""
    return [native_message(m) if native else plain_message(m) for m in messages]


def continuation(render: Render, result: str, tools: Sequence[dict[str, Any]] | None = None) -> str:
    """What follows an assistant's call in the prompt, up to where the model goes on: its turn's
    end, the result as a tool turn and the next assistant turn's start, cut from the template's
    own rendering. tools: the offered tools in OpenAI's form, for a template that renders them."""
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
    tool = {"role": "tool", "content": result}
    extra = {"tools": list(tools)} if tools else {}
    whole = render([*head, tool if tools else plain_message(tool)], add_generation_prompt=True, **extra)
    return whole[whole.index(_MARK) + len(_MARK):]
