"""A reply's tool calls as the conversation stores them, built from its tool events: one record
per call (a built-in call's running event and its outcome merge), each with the offset in the
reply's text where it was made, so the stored message renders again as the model saw it
(prompt.expand_assistant). The replica (its report) and the gateway (its save at the final event)
build them the same way, here."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from fairway.domain import ToolStatus
from fairway.relay.events import Event, TokenEvent, ToolEvent
from fairway.tools.spec import EXECUTE_CODE

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


def replayed(text: str, records: Sequence[CallRecord], outcomes_only: bool = False) -> list[TokenEvent | ToolEvent]:
    """transcript() the other way round: a stored reply as events (numbered 0: the caller numbers
    them), its text cut where each call was made, each call's events there (a built-in one's
    running event, then its outcome). outcomes_only: the calls' last events alone, no text."""
    events: list[TokenEvent | ToolEvent] = []
    pos = 0
    for record in records:
        at = min(max(int(record.get("at", 0)), pos), len(text))
        if at > pos and not outcomes_only:
            events.append(TokenEvent(0, text[pos:at]))
        pos = at
        status = ToolStatus(record["status"])
        call = ToolEvent(0, record["id"], record["name"], status, record.get("arguments", ""),
                         int(record.get("index", 0)), record.get("output", ""), record.get("detail") or {})
        if status in (ToolStatus.COMPLETED, ToolStatus.FAILED) and not outcomes_only:
            events.append(ToolEvent(0, call.call_id, call.name, ToolStatus.RUNNING, call.arguments))
        events.append(call)
    if pos < len(text) and not outcomes_only:
        events.append(TokenEvent(0, text[pos:]))
    return events


def client_run(record: CallRecord) -> dict[str, Any]:
    """A built-in call's run as a client reads it from the store (GET /v1/conversations/{id}, a
    non-streamed reply's message.tool_executions): the record in the streamed `tool_execution`
    chunk's words, so a client reads one shape streamed or not: the sandbox's detail as `result`
    (README's name; the record keeps `detail`), execute_code's code as `code`."""
    run = {k: v for k, v in record.items() if k != "detail"}
    if record.get("name") == EXECUTE_CODE:
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            run["code"] = json.loads(record.get("arguments", "")).get("code")
    if record.get("detail"):
        run["result"] = record["detail"]
    return run


def stored_tools(records: Sequence[CallRecord]) -> dict[str, Any] | None:
    """The message's tools column: its calls, or None for a reply that made none."""
    return {"calls": list(records)} if records else None
