"""The SSE relay: a reply's token log, as OpenAI chat.completion.chunk events.

Each token event n goes out as an SSE event with `id: n` and `checkpoint_id: "tok_n"`, so a
client that drops can come back to any gateway with Last-Event-ID and carry on after n. The
relay reads only the token log, never the replica: the replica never notices who is listening,
and listening from many gateways at once costs it nothing.

When the final event arrives the relay saves the reply in the store before it says [DONE], so
the client's next turn finds it in the history.

A tool event goes out as its own chunk: a client-defined call as OpenAI's `tool_calls` delta (whole:
id, name and all its arguments at once), a built-in tool's run (execute_code) as a chunk with an
empty delta and a `tool_execution` field (name, status running, then completed or failed with its
output), so a client shows the pause and then the result, and the reply's text carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from fairway.conversation import ConversationStore, Reply
from fairway.conversation.recorder import save_final, save_from_log
from fairway.conversation.service import ConversationService
from fairway.gateway.cursor import Cursor, wire_id
from fairway.gateway.edge import BODY_SEND
from fairway.gateway.errors import ApiError, not_found
from fairway.gateway.http_protocol import connection_of
from fairway.gateway.sse import ReplyView, chunk, chunk_base, frame, logprobs_of, token_template
from fairway.gateway.token_writer import make_writer
from fairway.relay import (
    EventIdOutOfRange,
    FinalEvent,
    RelayError,
    ReplyNotFound,
    ReplyState,
    TokenEvent,
    TokenLog,
    TokenLogprob,
    TokenSink,
    ToolEvent,
)
from fairway.router import NoReplica
from fairway.tools import EXECUTE_CODE
from fairway.tools.prompt import openai_call
from fairway.tools.record import CallRecord, add_event, client_run, replayed
from fairway.uncancelled import finish_anyway

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0  # an SSE comment this often while nothing happens, so proxies keep the line
RUNS_FOLLOWED = 4  # a stream follows a reply through this many lost logs, then ends with an error
DONE = b"data: [DONE]\n\n"
# A comment line alone, with no blank line after it: a blank line ends an event, and the OpenAI SDKs
# dispatch one (with empty data, which they then fail to parse as JSON) whenever an id: was seen
# before it. Browsers' EventSource and the page's reader skip the comment either way.
KEEPALIVE = b": keepalive\n"


@dataclass(frozen=True)
class Snapshot:
    """The whole stored text of a reply whose log expired: the client replaces what it has."""

    event: TokenEvent


Item = TokenEvent | ToolEvent | FinalEvent | Snapshot


def _renumbered(items: list[Item], run: int) -> list[Item]:
    """Items with the ids clients see for the reply's run `run` (cursor.py)."""
    if run == 0:
        return items
    return [Snapshot(dataclasses.replace(i.event, n=wire_id(run, i.event.n))) if isinstance(i, Snapshot)
            else dataclasses.replace(i, n=wire_id(run, i.n)) for i in items]


def usage(final: FinalEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def stopped(final: FinalEvent) -> bool:
    return final.state == ReplyState.STOPPED and final.error is None


def content_filter_results(final: FinalEvent) -> dict[str, Any]:
    """On a reply the output check stopped: what stopped it, per category (Azure OpenAI's field name)."""
    return {category: {"filtered": True} for category in final.categories}


def finish_reason(final: FinalEvent) -> str:
    if final.state == ReplyState.FLAGGED:
        return "content_filter"
    if final.finish_reason in ("length", "tool_calls"):
        return str(final.finish_reason)
    return "stop"


def tool_execution(event: ToolEvent) -> dict[str, Any]:
    """A built-in tool's run as a chunk's `tool_execution`: what runs (the code), then how it went."""
    out: dict[str, Any] = {"id": event.call_id, "name": event.name, "status": str(event.status),
                           "arguments": event.arguments}
    if event.name == EXECUTE_CODE:
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            out["code"] = json.loads(event.arguments).get("code")
    if event.output:
        out["output"] = event.output
    if event.detail:
        out["result"] = event.detail
    return out


def tool_call_delta(event: ToolEvent) -> dict[str, Any]:
    """A client-defined call as OpenAI streams it (here whole, in one delta)."""
    return {"index": event.index, **openai_call(event.call_id, event.name, event.arguments)}


def error_body(final: FinalEvent) -> dict[str, Any]:
    return {"error": {"message": f"The reply failed: {final.error}", "type": "server_error", "param": None,
                      "code": "generation_failed"}}


OnFinal = Callable[[FinalEvent], Awaitable[None]]


async def _run(on_final: OnFinal | None, final: FinalEvent) -> None:
    if on_final is None:
        return
    try:
        await on_final(final)
    except Exception:  # the stream must still end cleanly
        log.warning("an on-final hook failed", exc_info=True)


class ReplyRelay:
    def __init__(self, token_log: TokenLog, store: ConversationStore, service: ConversationService,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.log = token_log
        self.store = store
        self.service = service
        self.keepalive_s = keepalive_s

    # -- before the response starts: errors still get their status ---------------------------

    async def check_after(self, reply: Reply, after: int) -> None:
        """404 for a cursor past the end of the reply (no such event will ever exist)."""
        cursor = Cursor.of(after)
        if cursor.run > reply.restarts:
            raise not_found(f"Last-Event-ID {after} is past the end of reply {reply.id}.", "Last-Event-ID",
                            "event_id_out_of_range")
        if cursor.n == 0 or cursor.run < reply.restarts:
            return  # the start always exists; an earlier run's id gets this run from its start
        try:
            if await self.log.exists(reply.id):
                await self.log.read(reply.id, cursor.n, run=reply.restarts)  # EventIdOutOfRange past a finished end
                return
        except EventIdOutOfRange as exc:
            raise not_found(
                f"Last-Event-ID {after} is past the end of reply {reply.id}, which ended at event "
                f"{wire_id(reply.restarts, exc.last_n)}.",
                "Last-Event-ID",
                "event_id_out_of_range",
            ) from None
        except ReplyNotFound:
            pass
        if reply.finished and cursor.n > max(reply.last_event_id, 1):
            raise not_found(f"Last-Event-ID {after} is past the end of reply {reply.id}.", "Last-Event-ID",
                            "event_id_out_of_range")

    # -- events ------------------------------------------------------------------------------

    async def event_batches(self, reply: Reply, after: int, idle_s: float | None = None,
                            direct: TokenSink | None = None) -> AsyncIterator[list[Item]]:
        """The reply's events after the client's id `after`, numbered as clients see them
        (cursor.py), in the batches they arrive in: from its token log, or, once the log is gone,
        from the store (finished) or from a run again on its stored context (unfinished). A client
        whose id is of an earlier run gets the current run from its start, after a snapshot that
        empties its text. With idle_s, an empty batch whenever that long passed without events.
        direct goes to the token log (TokenLog.subscribe_batches) while the ids are the log's own."""
        cursor = Cursor.of(after)
        started = after > 0  # the client has text of this reply (a log can vanish mid-stream too)
        current, run, n = reply, cursor.run, cursor.n
        for _ in range(RUNS_FOLLOWED):
            moved = False  # this round sent the client events
            if run == current.restarts:
                try:
                    async with contextlib.aclosing(self._numbered(current, n, idle_s, direct)) as batches:
                        async for batch in batches:
                            moved = moved or bool(batch)
                            yield batch
                    return
                except ReplyNotFound:  # (LogReplaced too: its log is not the run this read)
                    started = started or moved
            current = await self.store.get_reply(reply.id) or current
            if current.finished:
                stale = started and (run < current.restarts or not n)
                yield _renumbered(await self._from_store(current, 1 if stale else n), current.restarts)
                return
            if not await self.log.exists(reply.id):
                try:
                    await self.service.restart(current)  # or another gateway just did: either way the log is back
                except NoReplica as exc:
                    yield [FinalEvent(after + 1, "abort", ReplyState.STOPPED, error=f"cannot continue the reply: {exc}")]
                    return
                current = await self.store.get_reply(reply.id) or current
                if not await self.log.exists(reply.id):
                    yield [FinalEvent(after + 1, "abort", ReplyState.STOPPED,
                                      error="the reply's token log was lost and it has no stored context to continue from")]
                    return
            if run == current.restarts and not moved:
                continue  # the client's run is the reply's (this read the row before a restart): its log
            if started:  # what the client has is of a run that is gone: it starts over
                yield [Snapshot(TokenEvent(wire_id(current.restarts, 0), ""))]
            # From the start of the run the row says now; a log that turns out to hold yet another
            # run (restarted again since this read) sends this round again.
            run, n, direct, started = current.restarts, 0, None, False
        yield [FinalEvent(after + 1, "abort", ReplyState.STOPPED,
                          error=f"the reply's token log was lost {RUNS_FOLLOWED} times while it was read")]

    async def _numbered(self, reply: Reply, n: int, idle_s: float | None,
                        direct: TokenSink | None) -> AsyncIterator[list[Item]]:
        """The log's batches after event n, with the ids clients see (the direct sink writes the
        log's own ids, so it is for a reply's first run only)."""
        run = reply.restarts
        async with contextlib.aclosing(self.log.subscribe_batches(reply.id, n, idle_s, direct if run == 0 else None,
                                                                  run=run)) as batches:
            async for batch in batches:
                yield _renumbered(batch, run)

    async def _from_store(self, reply: Reply, after: int) -> list[Item]:
        """A finished reply whose log expired, from its stored message: from the start, its text and
        its tool calls where they were made; after an event, its whole text (a snapshot, which
        replaces the client's) and each call's outcome (which replaces the client's view of it)."""
        message = next((m for m in await self.store.list_messages(reply.conversation_id) if m.reply_id == reply.id), None)
        text = message.text if message else ""
        calls = ((message.tools or {}).get("calls") or []) if message else []
        events = replayed(text, calls, outcomes_only=after > 0)
        if after > 0 or not events:
            events.insert(0, TokenEvent(0, text))
        last = max(reply.last_event_id, len(events) + 1)
        if after >= last:
            return []
        # The events the log held end just before `last`; a resumed client's come after its own id
        # (squeezed into what is left before `last`: the log held them in fewer numbers).
        items: list[Item] = [dataclasses.replace(e, n=min(last - 1, max(after + 1 + i, last - len(events) + i)))
                             for i, e in enumerate(events)]
        if after > 0:
            items[0] = Snapshot(items[0])  # type: ignore[arg-type]
        state = ReplyState(str(reply.state)) if reply.state.terminal else ReplyState.FINISHED
        reason = (reply.finish_reason if reply.finish_reason in ("stop", "length", "content_filter", "tool_calls")
                  else "stop")
        return [
            *items,
            FinalEvent(
                last,
                reason,  # type: ignore[arg-type]
                state,
                message.prompt_tokens if message else 0,
                message.cached_tokens if message else 0,
                message.completion_tokens if message else 0,
                categories=tuple(message.flagged_categories or ()) if message else (),
            ),
        ]

    # -- SSE ---------------------------------------------------------------------------------

    async def sse(self, reply: Reply, view: ReplyView, after: int, include_usage: bool,
                  on_final: OnFinal | None = None,
                  connection: asyncio.WriteTransport | None = None,
                  on_leave: Callable[[int], None] | None = None) -> AsyncIterator[bytes]:
        """SSE frames, for an EventStream. Events that arrive together go out in one write: under
        load that is what keeps a gateway's cost per event low. Read in the response's own task,
        straight from the token log's batches: no task or queue in between. With connection (the
        server's, see http_protocol), a plain token chunk that arrives while this waits is written
        from the token log's callback, with no task wake at all. A keepalive comment goes out after
        keepalive_s without events. on_final runs at the final event, before [DONE]; on_leave, when
        the stream ends without it (its client left), with the characters of reply text it sent."""
        tools: list[CallRecord] = []
        fresh = after == 0  # a stream from the start: its first chunk carries the role
        whole = fresh  # its text is all this stream sent (not after a snapshot replaced it)
        # Plain token chunks, and the reply's text as this stream sent it; with connection, also
        # the sink that writes them to it as HTTP chunks while this waits (keeping their text),
        # which it may not do before the first chunk is out. (This runs once EventStream started
        # the response, and its sends happen only while this is not waiting: the writer's bytes
        # land between them, in order.)
        # A reply with logprobs: every chunk rendered here (the writer's template has no logprobs).
        connection = None if view.logprobs else connection
        writer = make_writer(token_template(view), connection, open=not fresh)
        ended = False
        try:
            async with contextlib.aclosing(self.event_batches(reply, after, self.keepalive_s,
                                                              writer if connection is not None else None)) as batches:
                async for batch in batches:
                    if not batch:
                        yield KEEPALIVE
                        continue
                    out: list[bytes] = []
                    for event in batch:
                        if isinstance(event, FinalEvent):
                            ended = True
                            await self._save(reply.id, writer.text() if whole else None, event, tools)
                            await _run(on_final, event)
                            out += self._final_frames(view, event, fresh, include_usage)
                            yield b"".join(out) + DONE  # one write, which EventStream makes the last
                            return
                        if isinstance(event, ToolEvent):
                            add_event(tools, event, writer.chars)
                            out.append(self._tool_frame(view, event, fresh))
                            fresh = False
                            writer.open = True
                            continue
                        token = event.event if isinstance(event, Snapshot) else event
                        writer.add_text(token.text)
                        whole = whole and not isinstance(event, Snapshot)
                        if fresh or isinstance(event, Snapshot):
                            out.append(self._first_or_snapshot(view, event, fresh))
                            fresh = False
                            writer.open = True
                        elif view.logprobs:
                            out.append(frame(chunk(view, {"content": token.text}, token.n,
                                                   logprobs=logprobs_of(token.logprobs)), token.n))
                        else:
                            out.append(writer.chunk(token.n, token.text))
                    yield b"".join(out)
        except RelayError as exc:  # e.g. the log expired mid-stream: say so, end cleanly
            yield frame({"error": {"message": str(exc), "type": "server_error", "param": None,
                                   "code": "relay_error"}}) + DONE
            return
        finally:
            if on_leave is not None and not ended:
                on_leave(writer.chars)
        yield DONE

    def _first_or_snapshot(self, view: ReplyView, event: TokenEvent | Snapshot, fresh: bool) -> bytes:
        token = event.event if isinstance(event, Snapshot) else event
        delta: dict[str, Any] = {"role": "assistant", "content": token.text} if fresh else {"content": token.text}
        # (A snapshot's text, from the store, has no tokens behind it: no logprobs.)
        logprobs = logprobs_of(token.logprobs) if view.logprobs and not isinstance(event, Snapshot) else None
        first = chunk(view, delta, token.n, view.first_extra if fresh else {}, logprobs=logprobs)
        if isinstance(event, Snapshot):
            first["snapshot"] = True
        return frame(first, token.n)

    def _tool_frame(self, view: ReplyView, event: ToolEvent, fresh: bool) -> bytes:
        delta: dict[str, Any] = {"role": "assistant", "content": None} if fresh else {}
        extra = dict(view.first_extra) if fresh else {}
        if event.status == "call":
            delta["tool_calls"] = [tool_call_delta(event)]
        else:
            extra["tool_execution"] = tool_execution(event)
        return frame(chunk(view, delta, event.n, extra), event.n)

    def _final_frames(self, view: ReplyView, final: FinalEvent, fresh: bool, include_usage: bool) -> list[bytes]:
        if final.error:
            return [frame(error_body(final), final.n)]
        frames = [frame(self._final_chunk(view, final, fresh, view.first_extra if fresh else {}), final.n)]
        if include_usage:
            frames.append(frame({**chunk_base(view), "choices": [], "usage": usage(final)}))
        return frames

    def _final_chunk(self, view: ReplyView, final: FinalEvent, role: bool, extra: dict[str, Any]) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        last = chunk(view, delta, final.n, extra, finish_reason(final))
        if final.state == ReplyState.FLAGGED:
            last["choices"][0]["content_filter_results"] = content_filter_results(final)
        if stopped(final):
            last["choices"][0]["stopped"] = True  # finish_reason stays "stop": what OpenAI clients know
            last["stopped"] = True
        return last

    # -- one JSON response -------------------------------------------------------------------

    async def complete(self, reply: Reply, view: ReplyView, on_final: OnFinal | None = None) -> dict[str, Any]:
        """Wait for the whole reply (the request counts as a listener meanwhile)."""
        text: list[str] = []
        tools: list[CallRecord] = []
        logprobs: list[TokenLogprob] = []
        final: FinalEvent | None = None
        async with contextlib.aclosing(self.event_batches(reply, 0)) as batches:
            async for batch in batches:
                for event in batch:
                    if isinstance(event, FinalEvent):
                        final = event
                        break
                    if isinstance(event, ToolEvent):
                        add_event(tools, event, sum(map(len, text)))
                        continue
                    if isinstance(event, Snapshot):  # the text so far is replaced (a lost log's new run)
                        text.clear()
                        tools.clear()
                        logprobs.clear()
                    token = event.event if isinstance(event, Snapshot) else event
                    text.append(token.text)
                    logprobs += token.logprobs
                if final is not None:
                    break
        if final is None:
            raise ApiError(503, "The reply ended without a final event.", code="generation_failed")
        await self._save(reply.id, "".join(text), final, tools)
        await _run(on_final, final)
        if final.error:
            raise ApiError(503, f"The reply failed: {final.error}", code="generation_failed")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text), "refusal": None}
        calls = sorted((r for r in tools if r["status"] == "call"), key=lambda r: r["index"])
        if calls:
            message["tool_calls"] = [openai_call(r["id"], r["name"], r["arguments"]) for r in calls]
            message["content"] = message["content"] or None  # as OpenAI answers a reply of calls only
        runs = [r for r in tools if r["status"] != "call"]
        if runs:  # the built-in tool's runs, for clients that show them
            message["tool_executions"] = [client_run(r) for r in runs]  # as GET /v1/conversations/{id} lists them
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish_reason(final),
            "logprobs": logprobs_of(logprobs) if view.logprobs else None,
        }
        body: dict[str, Any] = {
            "id": view.reply_id,
            "object": "chat.completion",
            "created": view.created,
            "model": view.model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": usage(final),
            "reply_id": view.reply_id,
            "conversation_id": view.conversation_id,
            "message_id": view.message_id,
            "last_event_id": final.n,
            **view.first_extra,
        }
        if stopped(final):
            choice["stopped"] = body["stopped"] = True
        if final.state == ReplyState.FLAGGED:
            choice["content_filter_results"] = content_filter_results(final)
        return body

    async def _save(self, reply_id: str, text: str | None, final: FinalEvent,
                    tools: list[CallRecord] | None = None) -> None:
        """Save before [DONE]; best effort: the replica's report saves it anyway. A client that
        leaves meanwhile ends the stream, not the save: a write cancelled inside its transaction
        leaves the connection torn, and on SQLite its lock held, every other writer of the file
        waiting out the busy timeout (30 s) and failing, until that connection is collected."""
        # The store keeps the log's own n (its run is Reply.restarts), not the id clients saw.
        final = dataclasses.replace(final, n=Cursor.of(final.n).n)
        await finish_anyway(self._save_now(reply_id, text, final, tools))

    async def _save_now(self, reply_id: str, text: str | None, final: FinalEvent,
                        tools: list[CallRecord] | None) -> None:
        try:
            if text is None:
                saved = await save_from_log(self.store, self.log, reply_id)
            else:
                saved = await save_final(self.store, reply_id, text, final, tools)
            if saved:  # this process's recorder need not save it again
                self.service.launched.mark_saved(reply_id)
        except Exception:  # the stream must still end cleanly
            log.warning("could not save reply %s at its end", reply_id, exc_info=True)


class EventStream(Response):
    """The SSE response, lean on the path every event takes.

    Starlette's StreamingResponse writes from a task of its own in an anyio task group and, on a
    client disconnect, cancels it through a cancel scope, which cancels every later await of the
    body's cleanup too. Here the request's own task writes the body; a disconnect cancels it once,
    plain asyncio, so the body's cleanup (recording that a listener left) can await. Body chunks go
    to the send EdgeMiddleware kept (BODY_SEND), past the app's own send wrappers, which act on the
    response start only; the start and the end go the whole way. The chunk that ends with [DONE]
    ends the response in the same write (a write less per reply: each one wakes the client).
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None  # Response's interface; nothing runs after the stream
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = self.raw_headers
        if connection_of(scope) is not None:  # the body's framing, declared: the body may be written there
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        body_send = scope.get("state", {}).get(BODY_SEND, send)
        task = asyncio.current_task()
        assert task is not None
        streaming, gone = True, False

        cancels = 0

        async def watch() -> None:
            nonlocal gone, cancels
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = streaming  # (receive also says "disconnect" once the response is complete)
            while streaming:  # a cancel an await swallowed is asked again: the listener must leave
                cancels += 1
                task.cancel()
                await asyncio.sleep(1.0)

        watcher = asyncio.ensure_future(watch())
        try:
            async with contextlib.aclosing(self.body_iterator) as body:
                async for chunk in body:
                    if chunk.endswith(DONE):
                        streaming = False
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        return
                    await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            for _ in range(cancels):
                task.uncancel()  # the client left: that ends the response, not the request's task
        finally:
            streaming = False
            watcher.cancel()

