"""POST /v1/chat/completions: OpenAI-compatible, streamed (SSE) or one JSON response.

Beyond OpenAI's fields it takes the seed's: conversation_id (continue a stored conversation:
send only the new message), message_id / X-Idempotency-Key (a resend attaches to the reply
already running for that message) and last_received_token_index (resume a stream after it).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fairway.conversation import NotFound
from fairway.conversation.context import ContextTooLong
from fairway.conversation.service import NothingToResume, Turn, TurnRequest, UnknownModel
from fairway.gateway.auth import user_id
from fairway.gateway.context import gateway
from fairway.gateway.errors import ApiError, invalid, not_found, unavailable
from fairway.gateway.schemas import chat_messages, parse_chat_request, sampling
from fairway.gateway.streaming import ReplyView
from fairway.relay import RelayUnavailable
from fairway.router import NoReplica

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of events


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    body = parse_chat_request(await request.body())
    gw = gateway(request)
    turn_request = TurnRequest(
        user_id=user_id(request),
        model=body.model,
        messages=chat_messages(body),
        sampling=sampling(body),
        conversation_id=body.conversation_id,
        client_key=body.message_id or request.headers.get("x-idempotency-key") or None,
        resume_only=body.last_received_token_index is not None,
    )
    after = body.last_received_token_index or 0
    if turn_request.resume_only and not turn_request.client_key:
        raise invalid("last_received_token_index needs the message_id (or X-Idempotency-Key) of the message "
                      "whose reply to resume.", "last_received_token_index")
    turn = await _start(gw.service, turn_request)
    view = ReplyView.of(turn.reply, body.model)
    view.first_extra = _context_info(turn)
    headers = {**view.headers(), **_context_headers(turn)}
    if not body.stream:
        return JSONResponse(await gw.relay.complete(turn.reply, view), headers=headers)
    await gw.relay.check_after(turn.reply, after)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = gw.relay.sse(turn.reply, view, after, include_usage)
    return StreamingResponse(stream, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


async def _start(service, turn_request: TurnRequest) -> Turn:
    try:
        return await service.start_turn(turn_request)
    except UnknownModel as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None
    except NothingToResume as exc:
        raise not_found(f"There is no reply to resume: {exc}.", "last_received_token_index",
                        "reply_not_found") from None
    except NotFound:
        raise not_found(f"No conversation {turn_request.conversation_id!r}.", "conversation_id",
                        "conversation_not_found") from None
    except ContextTooLong as exc:
        raise invalid(str(exc), "messages", "context_length_exceeded") from None
    except NoReplica as exc:
        raise unavailable(str(exc), "no_replica") from None
    except RelayUnavailable as exc:
        raise unavailable(f"The token log is unavailable: {exc}", "relay_unavailable") from None


def _context_info(turn: Turn) -> dict[str, Any]:
    """Said in the response (first chunk, or the JSON body) when the context was built now."""
    if turn.context is None:
        return {}
    return {"context": {
        "prompt_tokens": turn.context.num_tokens,
        "dropped_turns": turn.context.dropped_turns,
        "dropped_messages": turn.context.dropped_messages,
        "max_tokens": turn.max_tokens,
    }}


def _context_headers(turn: Turn) -> dict[str, str]:
    if turn.context is None:
        return {}
    return {"X-Context-Tokens": str(turn.context.num_tokens),
            "X-Context-Dropped-Turns": str(turn.context.dropped_turns)}
