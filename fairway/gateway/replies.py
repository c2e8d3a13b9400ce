"""A reply by id: resume its stream (Last-Event-ID), stop it, see its state.

Any gateway serves any reply: everything needed is in the token log and the store.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request

from fairway.conversation import NotFound, Reply
from fairway.gateway.app_state import GatewayContext, gateway
from fairway.gateway.auth import authenticated, user_id
from fairway.gateway.chat import SSE_HEADERS, SSE_RESPONSE
from fairway.gateway.cursor import wire_id
from fairway.gateway.edge import add_cleanup
from fairway.gateway.errors import error_responses, not_found
from fairway.gateway.http_protocol import connection_of
from fairway.gateway.schemas import event_id
from fairway.gateway.sse import ReplyView
from fairway.gateway.streaming import EventStream
from fairway.relay import ReplyNotFound
from fairway.usage import metrics

router = APIRouter(dependencies=[Depends(authenticated)], responses=error_responses(401, 404, 503))


async def _reply(gw: GatewayContext, request: Request, reply_id: str) -> Reply:
    try:
        return await gw.service.reply_for_user(reply_id, user_id(request))
    except NotFound:
        raise not_found(f"No reply {reply_id!r}.", "reply_id", "reply_not_found") from None


@router.get("/v1/replies/{reply_id}/stream", response_class=EventStream, status_code=200,
            responses={200: SSE_RESPONSE, **error_responses(400)})
async def stream_reply(
    reply_id: str,
    request: Request,
    last_event_id: str | None = Header(None, alias="Last-Event-ID"),
    after: str | None = Query(None, description="The same as Last-Event-ID, for clients that cannot set it."),
    include_usage: str | None = Query(None, description="1 or true: a usage chunk before [DONE]."),
) -> EventStream:
    """SSE of the reply's events after Last-Event-ID (header, or ?after=): those already in the log
    at once, then the live ones."""
    gw = gateway(request)
    reply = await _reply(gw, request, reply_id)
    after_n = event_id(last_event_id) if last_event_id else event_id(after, "after")
    await gw.relay.check_after(reply, after_n)
    wants_usage = (include_usage or "").lower() in ("1", "true")
    view = ReplyView.of(reply)
    stream = gw.relay.sse(reply, view, after_n, wants_usage, connection=connection_of(request.scope))
    streams = metrics.ACTIVE_STREAMS.labels(view.model)
    streams.inc()
    add_cleanup(request, streams.dec)
    return EventStream(stream, headers={**SSE_HEADERS, **view.headers()})


def reply_context(job: dict[str, Any] | None) -> dict[str, Any]:
    """What a reply's context held beyond the conversation, from its stored job: the number of
    memories injected, the file chunks retrieved (sources)."""
    return {k: v for k, v in ((job or {}).get("context") or {}).items() if k in ("memories", "sources")}


@router.post("/v1/replies/{reply_id}/stop")
async def stop_reply(reply_id: str, request: Request) -> dict[str, Any]:
    """Stop generating: the replica drops the sequence at its next step, the text so far is saved
    with status stopped, and listeners get a final chunk saying so."""
    gw = gateway(request)
    reply = await _reply(gw, request, reply_id)
    try:
        pending = await gw.token_log.request_stop(reply.id)
    except ReplyNotFound:
        pending = False  # the log expired: the reply ended long ago, or nothing writes it
        await gw.service.stop_lost(reply)  # an orphan (its gateway died before it ran), or none
    return {"id": reply.id, "object": "reply.stop", "stop_requested": pending,
            "state": "STOPPING" if pending else str((await gw.store.get_reply(reply.id) or reply).state)}


@router.get("/v1/replies/{reply_id}")
async def get_reply(reply_id: str, request: Request) -> dict[str, Any]:
    gw = gateway(request)
    reply = await _reply(gw, request, reply_id)
    try:
        last = await gw.token_log.last_event_id(reply.id)
    except ReplyNotFound:
        last = reply.last_event_id
    last = wire_id(reply.restarts, last)  # as its stream numbers it (cursor.py)
    record = await gw.store.get_usage(reply.id)
    return {
        "id": reply.id,
        "object": "reply",
        "conversation_id": reply.conversation_id,
        "message_id": reply.message_id,
        "state": str(reply.state),
        "finish_reason": reply.finish_reason,
        "last_event_id": last,
        "replica_id": reply.replica_id,
        "created": int(reply.created_at),
        **reply_context(reply.job),
        "usage": None if record is None else {
            "model": record.model, "tier": record.tier, "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens, "completion_tokens": record.completion_tokens,
            "ttft_s": record.ttft_s, "duration_s": record.duration_s, "finish_reason": record.finish_reason,
            "cost": record.cost,
        },
    }
