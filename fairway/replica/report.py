"""What a replica reports about a reply, for the conversation store (it has no database itself).

Reports travel through an inbox (REPORTS_INBOX, fairway/relay/inbox.py); every gateway runs a
recorder that takes them and writes the store, so a reply nobody is watching is still saved when
it ends, and a report whose recorder died before saving it is taken again by another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

REPORTS_INBOX = "reports"

# "resumed": a failover handed the reply to another replica (replica_id), where it waits again.
ReportKind = Literal["started", "resumed", "finished"]


@dataclass
class ReplyReport:
    kind: ReportKind
    reply_id: str
    replica_id: str
    text: str = ""  # the whole reply (finished only)
    state: str = ""  # the final ReplyState (finished only)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_event_id: int = 0
    error: str | None = None
    ttft_s: float | None = None  # submission to first token (finished only; None if no token came)
    duration_s: float = 0.0  # submission to the end
    tools: list[dict[str, Any]] = field(default_factory=list)  # its tool calls (fairway/tools/record.py)
    categories: list[str] = field(default_factory=list)  # flagged: the moderation categories that stopped it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplyReport:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
