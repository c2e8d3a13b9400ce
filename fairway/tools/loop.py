"""One reply's tools on the replica: the call parser over its output, the execute_code runs in
the sandbox, and the prompt that continues the reply after each run.

The worker (replica/worker.py) drives it: text the parser releases goes out as tokens; a whole
call becomes tool events; a built-in call pauses the reply, runs, and the reply goes on in a new
engine request whose prompt is the old one, the tokens generated so far and the result (the
prefix cache keeps all of it warm), its events numbered on from the last.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fairway.domain import ToolStatus
from fairway.sandbox import RunResult, Sandbox, SandboxLimits
from fairway.tools.parser import CallParser, ParsedCall
from fairway.tools.prompt import Render, continuation
from fairway.tools.spec import EXECUTE_CODE, ToolSet

OUTPUT_CHARS = 4000  # of each stream, in what goes back to the model and to clients


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolOutcome:
    status: ToolStatus
    output: str  # the tool message the model reads
    detail: dict[str, Any] = field(default_factory=dict)  # for clients: the run's result


class ToolLoop:
    def __init__(self, tools: ToolSet, sandbox: Sandbox | None, render: Render, encode: Callable[[str], list[int]],
                 limits: SandboxLimits | None = None, tenant: str = "", native: bool = False) -> None:
        self.tools = tools
        self.native = native  # the template renders tools and tool turns itself
        self.sandbox = sandbox
        self.render = render
        self.encode = encode
        self.limits = limits or SandboxLimits()
        self.tenant = tenant
        self.parser = CallParser()
        self.rounds = 0  # tool runs so far (built-in runs and refused calls)
        self.client_calls = 0

    def is_client(self, call: ParsedCall) -> bool:
        return call.error is None and call.name in self.tools.client_names()

    @property
    def rounds_left(self) -> bool:
        return self.rounds < self.tools.max_rounds

    async def run(self, call: ParsedCall) -> ToolOutcome:
        """A call the replica answers itself: execute_code in the sandbox; anything it cannot use
        (an unknown tool, arguments that do not parse) answered with the reason, so the model can
        correct itself."""
        self.rounds += 1
        if call.error is not None:
            return ToolOutcome(ToolStatus.FAILED, f"error: {call.error}")
        if call.name != EXECUTE_CODE or not self.tools.code:
            offered = ", ".join(t.name for t in self.tools.offered)
            return ToolOutcome(ToolStatus.FAILED, f"error: there is no tool {call.name!r}; the tools are: {offered}")
        code = json.loads(call.arguments).get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolOutcome(ToolStatus.FAILED, "error: execute_code needs the code to run")
        if self.sandbox is None:
            return ToolOutcome(ToolStatus.FAILED, "error: code execution is off on this server")
        result = await self.sandbox.run(code, self.limits, self.tenant)
        return outcome(result, self.limits)

    def continuation_ids(self, output: str) -> list[int]:
        """The tokens that follow a call in the prompt: the result, and the assistant going on."""
        offered = [t.to_openai() for t in self.tools.offered] if self.native else None
        return self.encode(continuation(self.render, output, offered))


def _cut(text: str) -> str:
    return text if len(text) <= OUTPUT_CHARS else text[:OUTPUT_CHARS] + f"\n... ({len(text) - OUTPUT_CHARS} more characters)"


_LIMITS = {"wall_time": "the wall-time limit ({wall_s:g} s)", "cpu_time": "the CPU-time limit ({cpu_s:g} s)",
           "memory": "the memory limit ({memory_mb} MiB)", "output": "the output limit ({output_bytes} bytes)", "file_size": "the file-size limit ({file_mb} MiB)"}


def outcome(result: RunResult, limits: SandboxLimits) -> ToolOutcome:
    """A run's result as the model reads it (short: what a small model can use) and for clients."""
    if result.error is not None:
        return ToolOutcome(ToolStatus.FAILED, f"error: the code could not run: {result.error}",
                           {"error": result.error})
    detail = {"stdout": _cut(result.stdout), "stderr": _cut(result.stderr), "exit_code": result.exit_code,
              "signal": result.signal, "limit": result.limit, "truncated": result.truncated,
              "duration_s": round(result.duration_s, 3)}
    parts = []
    if result.stdout:
        parts.append(_cut(result.stdout).rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + _cut(result.stderr).rstrip("\n"))
    if result.limit:
        parts.append("stopped by " + _LIMITS[result.limit].format(**limits.to_dict()))
    elif result.exit_code not in (0, None):
        parts.append(f"exit status {result.exit_code}")
    elif result.signal is not None:
        parts.append(f"killed by signal {result.signal}")
    status = ToolStatus.COMPLETED if result.ok else ToolStatus.FAILED
    return ToolOutcome(status, "\n".join(parts) or "(no output)", detail)
