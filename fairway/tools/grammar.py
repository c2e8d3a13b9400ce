"""The grammar that holds a reply to a tool call, for tool_choice "required" or a named function:
one `<tool_call>{"name": ..., "arguments": ...}</tool_call>` whose name is one of the allowed
tools and whose arguments fit that tool's parameter schema, as a Lark grammar with the schemas
embedded (llguidance's %json), for the engine's guided decoding (fairway/engine/guided_decoding.py).
"""

from __future__ import annotations

import json

from fairway.tools.parser import CLOSE, OPEN
from fairway.tools.spec import ToolSet


def call_grammar(tools: ToolSet) -> str | None:
    """The Lark grammar of a forced call; None when the choice forces none (auto)."""
    if tools.choice == "function":
        allowed = [t for t in tools.offered if t.name == tools.named]
    elif tools.choice == "required":
        allowed = list(tools.offered)
    else:
        return None
    rules = [f'start: "{OPEN}>\\n" call "\\n{CLOSE}"', "call: " + " | ".join(f"call{i}" for i in range(len(allowed)))]
    for i, tool in enumerate(allowed):
        schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  # compact JSON, as json.dumps writes it (free whitespace wastes a model's tokens)
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        rules.append(f"call{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(rules)

