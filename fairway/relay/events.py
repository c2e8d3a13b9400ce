"""The events of one reply's token log, and their flat dict[str, str] form for Redis.

Every event carries n, its SSE event id: tokens are 1, 2, 3, ... and the terminal event takes
the next number, so a client that saw the terminal event can resume "after" it and get nothing,
while one that dropped just before it still gets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fairway.domain import FinishReason, ReplyState, ToolStatus


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability as OpenAI's logprobs give it: the token's text (its bytes
    decoded, U+FFFD for a part of a character), its bytes, and for a sampled token its position's
    most likely tokens, best first."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TokenLogprob] = field(default_factory=list)

    def to_json(self) -> list[Any]:
        return [self.token, self.logprob, self.bytes, [t.to_json()[:3] for t in self.top]]

    @classmethod
    def from_json(cls, data: list[Any]) -> TokenLogprob:
        token, logprob, raw = data[0], data[1], data[2]
        top = data[3] if len(data) > 3 else []
        return cls(str(token), float(logprob), [int(b) for b in raw], [cls.from_json(t) for t in top])


@dataclass(frozen=True)
class TokenEvent:
    """One step of output: text delta plus the token ids behind it (may be several, or none), and
    their logprobs when the reply asks for them (an event without them has none: older ones too)."""

    n: int  # 0 asks append() to assign the next number
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def to_fields(self) -> dict[str, str]:
        fields = {"k": "t", "n": str(self.n), "text": self.text, "ids": ",".join(map(str, self.token_ids))}
        if self.logprobs:
            fields["lp"] = json.dumps([t.to_json() for t in self.logprobs], separators=(",", ":"),
                                      ensure_ascii=False)
        return fields


@dataclass(frozen=True)
class ToolEvent:
    """A tool call of the reply: a client-defined call (status call), or a built-in one running
    (running) and then its outcome (completed / failed), each an event of its own with its own n,
    between the reply's tokens, so every listener and every replay sees the call where it was made."""

    n: int  # 0 asks append() to assign the next number
    call_id: str
    name: str
    status: ToolStatus
    arguments: str = ""  # the call's arguments, JSON text as OpenAI carries them
    index: int = 0  # the call's place among the reply's client tool calls (OpenAI's tool_calls[].index)
    output: str = ""  # the tool message that went back to the model (completed / failed)
    detail: dict[str, Any] = field(default_factory=dict)  # the run's result for clients: stdout, stderr, exit code

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ToolStatus(self.status))  # ValueError if not one

    def to_fields(self) -> dict[str, str]:
        fields = {"k": "x", "n": str(self.n), "id": self.call_id, "name": self.name, "status": str(self.status),
                  "args": self.arguments, "index": str(self.index)}
        if self.output:
            fields["output"] = self.output
        if self.detail:
            fields["detail"] = json.dumps(self.detail, separators=(",", ":"), ensure_ascii=False)
        return fields


@dataclass(frozen=True)
class FinalEvent:
    """The terminal event: why the reply ended, its state and its usage. Nothing follows it."""

    n: int  # 0 asks finish() to assign the next number
    finish_reason: FinishReason | str
    state: ReplyState
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    categories: tuple[str, ...] = ()  # content_filter: the moderation categories that stopped it

    def __post_init__(self) -> None:
        # Validate here so a bad terminal event fails at the producer, not in every client.
        object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))  # ValueError if not one
        state = ReplyState(self.state)
        if not state.terminal:
            raise ValueError(f"a final event needs a terminal state, got {state}")
        object.__setattr__(self, "state", state)

    def to_fields(self) -> dict[str, str]:
        fields = {
            "k": "f",
            "n": str(self.n),
            "reason": str(self.finish_reason),
            "state": str(self.state),
            "prompt": str(self.prompt_tokens),
            "cached": str(self.cached_tokens),
            "completion": str(self.completion_tokens),
        }
        if self.error is not None:
            fields["error"] = self.error
        if self.categories:
            fields["categories"] = ",".join(self.categories)
        return fields


Event = TokenEvent | ToolEvent | FinalEvent


def with_n(event: Event, n: int) -> Event:
    """The same event numbered n (append assigns numbers to events sent with n=0)."""
    if event.n == n:
        return event
    if isinstance(event, TokenEvent):
        return TokenEvent(n, event.text, list(event.token_ids), list(event.logprobs))
    if isinstance(event, ToolEvent):
        return ToolEvent(n, event.call_id, event.name, event.status, event.arguments, event.index, event.output,
                         dict(event.detail))
    return FinalEvent(
        n,
        event.finish_reason,
        event.state,
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
        event.error,
        event.categories,
    )


def event_from_fields(fields: dict[str, str]) -> Event:
    """Inverse of to_fields(); raises ValueError on anything that is not an event."""
    kind = fields.get("k")
    n = int(fields["n"])
    if kind == "t":
        ids = fields.get("ids", "")
        logprobs = [TokenLogprob.from_json(t) for t in json.loads(fields["lp"])] if fields.get("lp") else []
        return TokenEvent(n, fields.get("text", ""), [int(i) for i in ids.split(",")] if ids else [], logprobs)
    if kind == "x":
        try:
            return ToolEvent(n, fields["id"], fields["name"], ToolStatus(fields["status"]), fields.get("args", ""),
                             int(fields.get("index", 0)), fields.get("output", ""),
                             json.loads(fields["detail"]) if fields.get("detail") else {})
        except KeyError as exc:
            raise ValueError(f"a tool event without its {exc.args[0]!r}") from None
    if kind == "f":
        return FinalEvent(
            n,
            fields["reason"],
            ReplyState(fields["state"]),
            int(fields.get("prompt", 0)),
            int(fields.get("cached", 0)),
            int(fields.get("completion", 0)),
            fields.get("error"),
            tuple(fields["categories"].split(",")) if fields.get("categories") else (),
        )
    raise ValueError(f"not a token log event: kind {kind!r}")
