"""The bytes of a streamed reply: SSE events carrying OpenAI chat.completion.chunk objects, in the
HTTP/1.1 chunks of the response's body.

Rendered here once. A plain token's event, the one sent thousands of times a second, is also
filled in from a TokenTemplate cut out of this rendering (token_writer's Python and C writers), so
the chunk's layout is spelled nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fairway.conversation import Reply
from fairway.relay import TokenLogprob


@dataclass
class ReplyView:
    """What every chunk says about the reply."""

    reply_id: str
    conversation_id: str
    message_id: str
    model: str
    created: int
    first_extra: dict[str, Any] = field(default_factory=dict)  # e.g. context info, on a fresh stream's first chunk
    # The reply asked for logprobs: its token chunks carry them, so they are rendered here, never
    # by the token writer's template (which has none).
    logprobs: bool = False

    @classmethod
    def of(cls, reply: Reply, model: str | None = None) -> ReplyView:
        job = reply.job or {}
        model = model or str(job.get("model", ""))
        logprobs = (job.get("sampling") or {}).get("logprobs") is not None
        return cls(reply.id, reply.conversation_id, reply.message_id, model, int(reply.created_at), logprobs=logprobs)

    def headers(self) -> dict[str, str]:
        return {"X-Reply-Id": self.reply_id, "X-Conversation-Id": self.conversation_id, "X-Message-Id": self.message_id}


_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def frame(data: Any, event_id: int | None = None) -> bytes:
    """One SSE event: data as JSON, with `id: event_id` when it has one."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {_json(data)}\n\n".encode()


def http_chunk(body: bytes) -> bytes:
    """body as one HTTP/1.1 chunk of a chunked response (Transfer-Encoding: chunked)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


def chunk_base(view: ReplyView) -> dict[str, Any]:
    """What every chunk of a reply says about it."""
    return {
        "id": view.reply_id,
        "object": "chat.completion.chunk",
        "created": view.created,
        "model": view.model,
        "system_fingerprint": None,
        "reply_id": view.reply_id,
        "conversation_id": view.conversation_id,
    }


def chunk(view: ReplyView, delta: dict[str, Any], n: int, extra: dict[str, Any] | None = None,
          finish: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chunk of event n: its one choice's delta (and finish reason, and the logprobs of the
    delta's tokens), then any extra fields."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs, "checkpoint_id": f"tok_{n}"}
    return {**chunk_base(view), "choices": [choice], **(extra or {})}


def logprobs_of(tokens: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's choice.logprobs for these tokens (a chunk's, or a whole reply's)."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
                         "top_logprobs": [{"token": o.token, "logprob": o.logprob, "bytes": o.bytes} for o in t.top]}
                        for t in tokens],
            "refusal": None}


@dataclass(frozen=True)
class TokenTemplate:
    """A reply's plain token event (frame(chunk(view, {"content": text}, n), n)) as
    parts[0] + n + parts[1] + <text as a JSON string> + parts[2] + n + parts[3]."""

    parts: tuple[bytes, bytes, bytes, bytes]

    def event(self, n: int, text: str) -> bytes:
        p = self.parts
        return b"%b%d%b%b%b%d%b" % (p[0], n, p[1], _json(text).encode(), p[2], n, p[3])


_N = 987654321987654321  # marks where n goes: no reply gets that far
_TEXT = "\x00"  # marks where the text goes: rendered as "\u0000", which a JSON string of it is


def token_template(view: ReplyView) -> TokenTemplate:
    """The template cut from the rendering itself, at the markers. The event starts with n's id
    line, and the content string and the checkpoint's n come after every field of the view (the
    choices are the chunk's last field), so the view's values cannot be taken for a marker."""
    event = frame(chunk(view, {"content": _TEXT}, _N), _N)
    n, text = str(_N).encode(), _json(_TEXT).encode()
    id_at = event.index(n)
    text_at = event.rindex(text)
    n_at = event.index(n, text_at)
    return TokenTemplate((event[:id_at], event[id_at + len(n):text_at], event[text_at + len(text):n_at],
                          event[n_at + len(n):]))
