"""A reply's tool calls as the conversation stores them, built from its tool events: one record
per call (a built-in call's running event and its outcome merge), each with the offset in the
reply's text where it was made, so the stored message renders again as the model saw it
(prompt.expand_assistant). The replica (its report) and the gateway (its save at the final event)
build them the same way, here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fairway.relay.events import Event, TokenEvent, ToolEvent

CallRecord = dict[str, Any]  # id, name, arguments, status, index, output, detail, at


def add_event(records: list[CallRecord], event: ToolEvent, at: int) -> None:
    """Fold one tool event into the records (in place)."""
    for record in records:
        if record["id"] == event.call_id:
            record["status"] = str(event.status)
            if event.output:
                record["output"] = event.output
            if event.detail:
                record["detail"] = event.detail
            return
    record: CallRecord = {"id": event.call_id, "name": event.name, "arguments": event.arguments,
                          "status": str(event.status), "index": event.index, "at": at}
    if event.output:
        record["output"] = event.output
    if event.detail:
        record["detail"] = event.detail
    records.append(record)


def transcript(events: Sequence[Event]) -> tuple[str, list[CallRecord]]:
    """The text and the call records of a reply's events (a token log's, in order)."""
    text: list[str] = []
    size = 0
    records: list[CallRecord] = []
    for event in events:
        if isinstance(event, TokenEvent):
            text.append(event.text)
            size += len(event.text)
        elif isinstance(event, ToolEvent):
            add_event(records, event, size)
    return "".join(text), records


def stored_tools(records: Sequence[CallRecord]) -> dict[str, Any] | None:
    """The message's tools column: its calls, or None for a reply that made none."""
    return {"calls": list(records)} if records else None
