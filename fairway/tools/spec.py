"""The tools of one request: OpenAI's `tools` and `tool_choice`, checked, as plain data that
travels with the reply's job to the replica.

A client defines functions ({"type": "function", "function": {name, description, parameters}});
the built-in execute_code tool (Python run in the sandbox, inside the reply) is asked for with
{"type": "code_interpreter"}, OpenAI's name for it. tool_choice is "auto", "none", "required" or
{"type": "function", "function": {"name"}} (the built-in one may be named too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

EXECUTE_CODE = "execute_code"
CODE_TOOL_TYPE = "code_interpreter"
EXECUTE_CODE_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python 3 source; print what you want to see."}},
    "required": ["code"],
}
EXECUTE_CODE_DESCRIPTION = ("Run Python 3 code in an isolated sandbox (no network, no files but a private /tmp) "
                            "and see its standard output, standard error and exit status.")
DEFAULT_MAX_ROUNDS = 5  # tool runs per reply; then the reply ends and says so
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("auto", "none", "required")


class ToolError(ValueError):
    """A request's tools or tool_choice are malformed: the message and the parameter it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


CODE_TOOL = FunctionTool(EXECUTE_CODE, EXECUTE_CODE_DESCRIPTION, EXECUTE_CODE_PARAMETERS)


@dataclass(frozen=True)
class ToolSet:
    """What the reply may call: the client's functions, the built-in code tool, and the choice."""

    functions: tuple[FunctionTool, ...] = ()
    code: bool = False  # execute_code is offered
    choice: str = "auto"  # auto | required | function (none never makes a ToolSet: no tools at all)
    named: str | None = None  # with choice "function": the tool that must be called
    max_rounds: int = DEFAULT_MAX_ROUNDS
    parallel: bool = True  # parallel_tool_calls: false holds the model to one client call per reply

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        """Every tool the model is told about, the built-in one last."""
        return (*self.functions, CODE_TOOL) if self.code else self.functions

    def client_names(self) -> set[str]:
        return {f.name for f in self.functions}

    def to_dict(self) -> dict[str, Any]:
        return {"functions": [{"name": f.name, "description": f.description, "parameters": f.parameters}
                              for f in self.functions],
                "code": self.code, "choice": self.choice, "named": self.named, "max_rounds": self.max_rounds,
                "parallel": self.parallel}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolSet:
        return cls(tuple(FunctionTool(f["name"], f.get("description", ""), f.get("parameters") or {})
                         for f in data.get("functions") or ()),
                   bool(data.get("code")), str(data.get("choice") or "auto"), data.get("named"),
                   int(data.get("max_rounds", DEFAULT_MAX_ROUNDS)), bool(data.get("parallel", True)))


def parse_tools(tools: Any, tool_choice: Any, max_rounds: int = DEFAULT_MAX_ROUNDS,
                parallel_tool_calls: bool | None = None) -> ToolSet | None:
    """The request's tools, tool_choice and parallel_tool_calls as a ToolSet; None when the reply
    has no tools (none given, or tool_choice "none"). ToolError for anything malformed."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array of tools.", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"At most {MAX_TOOLS} tools per request.", "tools")
    functions: list[FunctionTool] = []
    code = False
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"'{where}' must be an object.", where)
        kind = tool.get("type")
        if kind == CODE_TOOL_TYPE:
            code = True
            continue
        if kind != "function":
            raise ToolError(f"'{where}.type' must be 'function' or '{CODE_TOOL_TYPE}', got {kind!r}.", f"{where}.type")
        functions.append(_function(tool.get("function"), f"{where}.function"))
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ToolError(f"Two tools are named {duplicate!r}: tool names must be unique.", "tools")
    choice, named = _choice(tool_choice, set(names) | ({EXECUTE_CODE} if code else set()))
    if choice == "none" or not (functions or code):
        return None
    return ToolSet(tuple(functions), code, choice, named, max_rounds, parallel_tool_calls is not False)


def _function(raw: Any, where: str) -> FunctionTool:
    if not isinstance(raw, dict):
        raise ToolError(f"'{where}' must be an object with a name.", where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"'{where}.name' must be 1 to 64 letters, digits, underscores or dashes.", f"{where}.name")
    if name == EXECUTE_CODE:
        raise ToolError(f"'{EXECUTE_CODE}' is the built-in tool's name: ask for it with "
                        f"{{\"type\": \"{CODE_TOOL_TYPE}\"}}.", f"{where}.name")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"'{where}.description' must be a string.", f"{where}.description")
    parameters = raw.get("parameters", {"type": "object", "properties": {}})
    check_parameters(parameters, f"{where}.parameters")
    return FunctionTool(name, description, parameters)


def check_parameters(schema: Any, where: str) -> None:
    """A function's parameters: a JSON Schema object describing an object (what OpenAI accepts)."""
    if not isinstance(schema, dict):
        raise ToolError(f"'{where}' must be a JSON Schema object.", where)
    if schema.get("type", "object") != "object":
        raise ToolError(f"'{where}.type' must be 'object': a function takes named arguments.", f"{where}.type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise ToolError(f"'{where}.properties' must map each argument's name to its schema.", f"{where}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"'{where}.required' must be an array of argument names.", f"{where}.required")
    try:
        json.dumps(schema)
    except (TypeError, ValueError):
        raise ToolError(f"'{where}' must be plain JSON.", where) from None
    error = schema_error(schema)
    if error:
        raise ToolError(f"'{where}' is not a usable JSON Schema: {error}.", where)


def schema_error(schema: dict) -> str | None:
    """Why llguidance cannot hold output to this JSON Schema (None: it can, or llguidance is not
    installed here and the replica will say). The gateway asks before the reply starts, so a bad
    schema is the client's 400, not a failed reply."""
    try:
        import llguidance
    except ImportError:
        return None
    try:
        message = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    return message or None


def _choice(raw: Any, names: set[str]) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in _CHOICES:
            raise ToolError(f"'tool_choice' must be one of {', '.join(_CHOICES)} or a named function, got {raw!r}.",
                            "tool_choice")
        if raw == "required" and not names:
            raise ToolError("tool_choice 'required' needs at least one tool in 'tools'.", "tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if not isinstance(name, str) or name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in 'tools'"
                            + (f" (defined: {', '.join(sorted(names))})." if names else " (no tools given)."),
                            "tool_choice")
        return "function", name
    raise ToolError("'tool_choice' must be 'auto', 'none', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")


def check_arguments(arguments: Any, where: str) -> str:
    """A tool call's arguments as a client sends them back: a JSON text of an object."""
    if not isinstance(arguments, str):
        raise ToolError(f"'{where}' must be a string holding a JSON object.", where)
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolError(f"'{where}' does not parse as JSON: {exc}.", where) from None
    if not isinstance(value, dict):
        raise ToolError(f"'{where}' must be a JSON object, got {type(value).__name__}.", where)
    return arguments
