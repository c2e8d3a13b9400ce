"""Function calling: the request's tools (spec.py), how they are put in the prompt (prompt.py),
tool calls parsed from the model's output (parser.py), the execute_code loop inside one reply
(loop.py), and the calls as the conversation stores them (record.py)."""

from fairway.tools.spec import EXECUTE_CODE, FunctionTool, ToolError, ToolSet, parse_tools

__all__ = ["EXECUTE_CODE", "FunctionTool", "ToolError", "ToolSet", "parse_tools"]
