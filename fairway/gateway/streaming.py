"""The SSE relay: a reply's token log, as OpenAI chat.completion.chunk events.

Each token event n goes out as an SSE event with `id: n` and `checkpoint_id: "tok_n"`, so a
client that drops can come back to any gateway with Last-Event-ID and carry on after n. The
relay reads only the token log, never the replica: the replica never notices who is listening,
and listening from many gateways at once costs it nothing.

When the final event arrives the relay saves the reply in the store before it says [DONE], so
the client's next turn finds it in the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fairway.conversation import ConversationStore, Reply
from fairway.conversation.recorder import save_final, save_from_log
from fairway.conversation.service import ConversationService
from fairway.gateway.errors import ApiError, not_found
from fairway.relay import (
    EventIdOutOfRange,
    FinalEvent,
    RelayError,
    ReplyNotFound,
    ReplyState,
    TokenEvent,
    TokenLog,
)
from fairway.router import NoReplica

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0  # an SSE comment this often while nothing happens, so proxies keep the line
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


@dataclass
class ReplyView:
    """What every chunk says about the reply."""

    reply_id: str
    conversation_id: str
    message_id: str
    model: str
    created: int
    first_extra: dict[str, Any] = field(default_factory=dict)  # e.g. context info, on a fresh stream's first chunk

    @classmethod
    def of(cls, reply: Reply, model: str | None = None) -> ReplyView:
        model = model or str((reply.job or {}).get("model", ""))
        return cls(reply.id, reply.conversation_id, reply.message_id, model, int(reply.created_at))

    def headers(self) -> dict[str, str]:
        return {"X-Reply-Id": self.reply_id, "X-Conversation-Id": self.conversation_id, "X-Message-Id": self.message_id}


@dataclass(frozen=True)
class Snapshot:
    """The whole stored text of a reply whose log expired: the client replaces what it has."""

    event: TokenEvent


def frame(data: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def usage(final: FinalEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def stopped(final: FinalEvent) -> bool:
    return final.state == ReplyState.STOPPED and final.error is None


def finish_reason(final: FinalEvent) -> str:
    if final.state == ReplyState.FLAGGED:
        return "content_filter"
    return "length" if final.finish_reason == "length" else "stop"


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
    def __init__(self, token_log: TokenLog, store: ConversationStore, service: ConversationService) -> None:
        self.log = token_log
        self.store = store
        self.service = service

    # -- before the response starts: errors still get their status ---------------------------

    async def check_after(self, reply: Reply, after: int) -> None:
        """404 for a cursor past the end of the reply (no such event will ever exist)."""
        if after == 0:
            return  # the start always exists
        try:
            if await self.log.exists(reply.id):
                await self.log.read(reply.id, after)  # raises EventIdOutOfRange past a finished end
                return
        except EventIdOutOfRange as exc:
            raise not_found(
                f"Last-Event-ID {after} is past the end of reply {reply.id}, which ended at event {exc.last_n}.",
                "Last-Event-ID",
                "event_id_out_of_range",
            ) from None
        except ReplyNotFound:
            pass
        if reply.finished and after > max(reply.last_event_id, 1):
            raise not_found(f"Last-Event-ID {after} is past the end of reply {reply.id}.", "Last-Event-ID",
                            "event_id_out_of_range")

    # -- events ------------------------------------------------------------------------------

    async def events(self, reply: Reply, after: int) -> AsyncIterator[TokenEvent | FinalEvent | Snapshot]:
        """The reply's events after `after`: from its token log, or, once the log has expired,
        from the store (finished) or from a restart on its stored context (unfinished)."""
        try:
            async with contextlib.aclosing(self.log.subscribe(reply.id, after)) as events:
                async for event in events:
                    yield event
            return
        except ReplyNotFound:
            pass
        current = await self.store.get_reply(reply.id) or reply
        if current.finished:
            async for event in self._from_store(current, after):
                yield event
            return
        try:
            await self.service.restart(current)  # or another gateway just did: either way the log is back
        except NoReplica as exc:
            yield FinalEvent(after + 1, "abort", ReplyState.STOPPED, error=f"cannot continue the reply: {exc}")
            return
        if not await self.log.exists(reply.id):
            yield FinalEvent(after + 1, "abort", ReplyState.STOPPED,
                             error="the reply's token log expired and it has no stored context to continue from")
            return
        async with contextlib.aclosing(self.log.subscribe(reply.id, 0)) as events:
            async for event in events:
                yield event

    async def _from_store(self, reply: Reply, after: int) -> AsyncIterator[TokenEvent | FinalEvent | Snapshot]:
        message = next((m for m in await self.store.list_messages(reply.conversation_id) if m.reply_id == reply.id), None)
        last = max(reply.last_event_id, 2)
        if after >= last:
            return
        text = message.text if message else ""
        token = TokenEvent(last - 1, text)
        yield token if after == 0 else Snapshot(token)
        state = ReplyState(str(reply.state)) if reply.state.terminal else ReplyState.FINISHED
        reason = reply.finish_reason if reply.finish_reason in ("stop", "length", "content_filter") else "stop"
        yield FinalEvent(
            last,
            reason,  # type: ignore[arg-type]
            state,
            message.prompt_tokens if message else 0,
            message.cached_tokens if message else 0,
            message.completion_tokens if message else 0,
        )

    # -- SSE ---------------------------------------------------------------------------------

    async def sse(self, reply: Reply, view: ReplyView, after: int, include_usage: bool,
                  on_final: OnFinal | None = None) -> AsyncIterator[bytes]:
        """SSE frames. Events that arrive together go out in one write: under load that is what
        keeps a gateway's cost per event low. on_final runs at the final event, before [DONE]."""
        text: list[str] = []
        fresh = after == 0  # a stream from the start: its first chunk carries the role
        fast = FastChunks(view)
        async with EventPump(self.events(reply, after), KEEPALIVE_S) as pump:
            try:
                async for batch in pump.batches():
                    out: list[bytes] = []
                    for event in batch:
                        if event is None:
                            out.append(KEEPALIVE)
                        elif isinstance(event, FinalEvent):
                            await self._save(reply.id, "".join(text) if after == 0 else None, event)
                            await _run(on_final, event)
                            out += self._final_frames(view, event, fresh, include_usage)
                            yield b"".join(out)
                            yield DONE
                            return
                        else:
                            token = event.event if isinstance(event, Snapshot) else event
                            text.append(token.text)
                            if fresh or isinstance(event, Snapshot):
                                out.append(self._first_or_snapshot(view, event, fresh))
                                fresh = False
                            else:
                                out.append(fast.token(token.n, token.text))
                    yield b"".join(out)
            except RelayError as exc:  # e.g. the log expired mid-stream: say so, end cleanly
                yield frame({"error": {"message": str(exc), "type": "server_error", "param": None,
                                       "code": "relay_error"}})
        yield DONE

    def _first_or_snapshot(self, view: ReplyView, event: TokenEvent | Snapshot, fresh: bool) -> bytes:
        token = event.event if isinstance(event, Snapshot) else event
        delta: dict[str, Any] = {"role": "assistant", "content": token.text} if fresh else {"content": token.text}
        chunk = self._chunk(view, delta, token.n, view.first_extra if fresh else {})
        if isinstance(event, Snapshot):
            chunk["snapshot"] = True
        return frame(chunk, token.n)

    def _final_frames(self, view: ReplyView, final: FinalEvent, fresh: bool, include_usage: bool) -> list[bytes]:
        if final.error:
            return [frame(error_body(final), final.n)]
        frames = [frame(self._final_chunk(view, final, fresh, view.first_extra if fresh else {}), final.n)]
        if include_usage:
            frames.append(frame({**self._chunk_base(view), "choices": [], "usage": usage(final)}))
        return frames

    def _chunk_base(self, view: ReplyView) -> dict[str, Any]:
        return {
            "id": view.reply_id,
            "object": "chat.completion.chunk",
            "created": view.created,
            "model": view.model,
            "system_fingerprint": None,
            "reply_id": view.reply_id,
            "conversation_id": view.conversation_id,
        }

    def _chunk(self, view: ReplyView, delta: dict[str, Any], n: int, extra: dict[str, Any],
               finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, "checkpoint_id": f"tok_{n}"}
        return {**self._chunk_base(view), "choices": [choice], **extra}

    def _final_chunk(self, view: ReplyView, final: FinalEvent, role: bool, extra: dict[str, Any]) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        chunk = self._chunk(view, delta, final.n, extra, finish_reason(final))
        if stopped(final):
            chunk["choices"][0]["stopped"] = True  # finish_reason stays "stop": what OpenAI clients know
            chunk["stopped"] = True
        return chunk

    # -- one JSON response -------------------------------------------------------------------

    async def complete(self, reply: Reply, view: ReplyView, on_final: OnFinal | None = None) -> dict[str, Any]:
        """Wait for the whole reply (the request counts as a listener meanwhile)."""
        text: list[str] = []
        final: FinalEvent | None = None
        async for event in self.events(reply, 0):
            if isinstance(event, FinalEvent):
                final = event
                break
            token = event.event if isinstance(event, Snapshot) else event
            text.append(token.text)
        if final is None:
            raise ApiError(503, "The reply ended without a final event.", code="generation_failed")
        await self._save(reply.id, "".join(text), final)
        await _run(on_final, final)
        if final.error:
            raise ApiError(503, f"The reply failed: {final.error}", code="generation_failed")
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(text), "refusal": None},
            "finish_reason": finish_reason(final),
            "logprobs": None,
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
        return body

    async def _save(self, reply_id: str, text: str | None, final: FinalEvent) -> None:
        """Save before [DONE]; best effort: the replica's report saves it anyway."""
        try:
            if text is None:
                await save_from_log(self.store, self.log, reply_id)
            else:
                await save_final(self.store, reply_id, text, final)
        except Exception:  # the stream must still end cleanly
            log.warning("could not save reply %s at its end", reply_id, exc_info=True)


class FastChunks:
    """The plain token chunk, the one sent thousands of times a second, by string formatting: the
    parts that never change for a reply are serialized once."""

    def __init__(self, view: ReplyView) -> None:
        base = {
            "id": view.reply_id,
            "object": "chat.completion.chunk",
            "created": view.created,
            "model": view.model,
            "system_fingerprint": None,
            "reply_id": view.reply_id,
            "conversation_id": view.conversation_id,
        }
        self._head = json.dumps(base, separators=(",", ":"), ensure_ascii=False)[:-1] + \
            ',"choices":[{"index":0,"delta":{"content":'

    def token(self, n: int, text: str) -> bytes:
        content = json.dumps(text, ensure_ascii=False)
        return (f'id: {n}\ndata: {self._head}{content}}},"finish_reason":null,"logprobs":null,'
                f'"checkpoint_id":"tok_{n}"}}]}}\n\n').encode()


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class EventPump:
    """Reads an event source in a task of its own into a queue.

    * The writer takes everything that has arrived at once (batches()), one write for many events.
    * A timer puts None (a keepalive) in the queue when nothing came for keepalive_s.
    * Leaving cancels the reader task, which then runs the source's cleanup (for Redis: recording
      that this listener left) to the end. Inside a client disconnect the request's own cancel
      scope would cancel every await again and cut that cleanup short.
    """

    def __init__(self, source: AsyncIterator[Any], keepalive_s: float) -> None:
        self._source = source
        self._keepalive_s = keepalive_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._quiet = True  # nothing delivered since the last timer tick

    async def __aenter__(self) -> EventPump:
        self._task = asyncio.get_running_loop().create_task(self._read())
        _pumps.add(self._task)
        self._task.add_done_callback(_pumps.discard)
        self._arm()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()  # not awaited, on purpose (see the class docstring)

    async def _read(self) -> None:
        try:
            async for event in self._source:
                self._queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the writer, which decides what the client sees
            self._queue.put_nowait(_Failed(exc))
            return
        self._queue.put_nowait(_END)

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._keepalive_s, self._tick)

    def _tick(self) -> None:
        if self._quiet and self._queue.empty():
            self._queue.put_nowait(None)
        self._quiet = True
        self._arm()

    async def batches(self) -> AsyncIterator[list[Any]]:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._quiet = False
            for i, item in enumerate(batch):
                if item is _END:
                    if i:
                        yield batch[:i]
                    return
                if isinstance(item, _Failed):
                    if i:
                        yield batch[:i]
                    raise item.error
            yield batch


_pumps: set[asyncio.Task] = set()  # strong references: a running reader must not be collected
