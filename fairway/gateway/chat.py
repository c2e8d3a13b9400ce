"""POST /v1/chat/completions: OpenAI-compatible, streamed (SSE) or one JSON response.

Beyond OpenAI's fields it takes the seed's: conversation_id (continue a stored conversation:
send only the new message), message_id / X-Idempotency-Key (a resend attaches to the reply
already running for that message) and last_received_token_index (resume a stream after it).

The edge, in order: the key (401), the body (400), the request rate per user and per IP (429),
the gateway's admission queue (503 + Retry-After after a bounded wait), the idempotency key
(a duplicate attaches to the first request's reply; another body under the same key is 409),
single-flight for identical cacheable requests (one generation, many streams), and, once the
context is built and its size known, the token reservation (prompt + max_tokens, 429 over
the user's TPM; a request that follows another's generation reserves the same). The reservation
is settled when the reply ends (usage/accounting.py; a follower's by its own bill, here).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fairway.conversation import Attachment, ConversationBusy, NotFound, Reply
from fairway.conversation.context_builder import ContextTooLong
from fairway.conversation.service import (
    Admitted,
    InputFlagged,
    NothingToResume,
    OverQuota,
    Shed,
    ToolUnavailable,
    Turn,
    TurnRequest,
    UnknownModel,
)
from fairway.gateway.app_state import GatewayContext, gateway
from fairway.gateway.auth import BEARER_REQUIRED, authenticate
from fairway.gateway.edge import add_cleanup, client_ip, set_ratelimit_headers
from fairway.gateway.errors import ApiError, error_responses, invalid, not_found, unavailable
from fairway.gateway.http_protocol import connection_of
from fairway.gateway.keys import Principal
from fairway.gateway.limit_errors import (
    check_max_tokens,
    count_refusal,
    denied_error,
    guarded,
    overloaded_error,
)
from fairway.gateway.schemas import (
    ChatCompletionRequest,
    chat_messages,
    event_id,
    file_ids,
    max_tokens_of,
    parse_chat,
    request_body,
    sampling,
    tool_set,
)
from fairway.gateway.sse import ReplyView
from fairway.gateway.streaming import EventStream
from fairway.limits import (
    Allowed,
    Claimed,
    Denied,
    LimitsError,
    LimitsUnavailable,
    Overloaded,
    Reservation,
    WindowState,
    body_fingerprint,
    check_key,
    flight_fingerprint,
    is_cacheable,
    rate_limit_headers,
    request_rate_headers,
)
from fairway.relay import FinalEvent, FinishReason, RelayError, RelayUnavailable, ReplyState, TokenEvent
from fairway.replica.registry import REGION
from fairway.router import RETRY_AFTER_S, NoReplica
from fairway.tools import ToolError
from fairway.uncancelled import finish_anyway
from fairway.usage import metrics
from fairway.usage.accounting import reservation_meta

log = logging.getLogger(__name__)
router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of events
# Body fields that do not change what is generated: a resend may differ in them.
NOT_FINGERPRINTED = ("stream", "stream_options", "last_received_token_index")
CLAIM_ATTEMPTS = 3


class Edge:
    """One chat request's way through the limits."""

    def __init__(self, request: Request, gw: GatewayContext, principal: Principal, data: dict[str, Any],
                 body: ChatCompletionRequest) -> None:
        self.request = request
        self.gw = gw
        self.limits = gw.limits
        self.principal = principal
        self.user = principal.user_id
        self.data = data
        self.body = body
        self.requests_state: WindowState | None = None
        self.allowed: Allowed | None = None  # this request as the request rate counted it
        self.reservation: Reservation | None = None
        self.key: str | None = None  # the idempotency key this request claimed
        self.flight: str | None = None  # the single-flight fingerprint, when cacheable
        self.follows = False  # single flight: this request is served another's generation, billed on its own
        self.followed: Reply | None = None  # the reply it follows
        self.sent_chars: int | None = None  # a follower whose client left: the reply text it was sent
        self.billed = False  # a follower's usage recorded and its reservation settled
        self.started = time.monotonic()

    # -- limits ----------------------------------------------------------------------------------

    async def hit_request_rate(self) -> None:
        allowed = await guarded(self.limits.requests.hit(self.user, self.principal.tier, client_ip(self.request)))
        if isinstance(allowed, Denied):
            if allowed.scope == "ip":  # the client IP's window, not the user's, refused: its headers alone
                headers = request_rate_headers(allowed.state)
            else:
                tokens = await guarded(self.limits.tokens.state(self.user, self.body.model, self.principal.tier))
                headers = rate_limit_headers(allowed.state, tokens)
            set_ratelimit_headers(self.request, headers)
            raise denied_error(allowed, headers)
        self.requests_state = allowed.state
        self.allowed = allowed

    async def refund_request(self) -> None:
        """Give this request back to the request rate (once; best effort: a store that is down
        keeps it counted until it ages out of the window, over-counted, never under)."""
        allowed, self.allowed = self.allowed, None
        if allowed is not None:
            with contextlib.suppress(LimitsUnavailable):
                await self.limits.requests.refund(allowed)

    async def admit_slot(self) -> None:
        try:
            slot = await self.limits.admission.acquire()
        except Overloaded as exc:
            raise overloaded_error(exc) from None
        add_cleanup(self.request, slot.release)  # when the response (stream included) is over

    async def admit_tokens(self, model: str, prompt_tokens: int, max_tokens: int) -> Admitted:
        """Called by the service once the context is built: reserve prompt + max_tokens of the
        model that serves (the mini pool's has its own quota). Spent: OverQuota, so the mini
        pool may serve instead (the service raises the 429 when none does)."""
        tier = self.principal.tier
        got = await guarded(self.limits.tokens.reserve(self.user, model, tier, prompt_tokens + max_tokens))
        if isinstance(got, Denied):
            assert self.requests_state is not None
            headers = rate_limit_headers(self.requests_state, got.state)
            set_ratelimit_headers(self.request, headers)
            raise OverQuota(denied_error(got, headers))
        self.reservation = got
        meta: dict[str, Any] = {"user": self.user, "tier": tier, "quota": reservation_meta(got)}
        if self.key:
            meta["idempotency_key"] = self.key
        if self.flight:
            meta["flight"] = self.flight
        return Admitted(meta, lambda: guarded(self.limits.tokens.release(got)))

    async def ratelimit_headers(self) -> dict[str, str]:
        assert self.requests_state is not None
        tokens = (self.reservation.state if self.reservation is not None else
                  await guarded(self.limits.tokens.state(self.user, self.body.model, self.principal.tier)))
        return rate_limit_headers(self.requests_state, tokens)

    # -- idempotency -----------------------------------------------------------------------------

    async def claim(self, key: str) -> Reply | None:
        """Own the key (None), or the reply of the request that owns it."""
        idem = self.limits.idempotency
        fingerprint = body_fingerprint({k: v for k, v in self.data.items() if k not in NOT_FINGERPRINTED})
        wait_s = self.limits.config.admission_timeout_s + 5.0
        for _ in range(CLAIM_ATTEMPTS):
            got = await guarded(idem.claim(self.user, key, fingerprint))
            if isinstance(got, Claimed):
                self.key = key
                return None
            if got.conflict:
                # x-should-retry: the OpenAI SDKs retry every 409 (twice by default), each time the same answer.
                raise ApiError(409, "This idempotency key was already used with a different request body. Use a "
                                    "new key for a new request.", param="X-Idempotency-Key",
                               code="idempotency_key_reused", headers={"x-should-retry": "false"})
            existing = got
            if existing.reply_id is None:
                existing = await guarded(idem.wait_for_reply(self.user, key, fingerprint, timeout=wait_s))
                if existing is None:
                    continue  # the first request gave up before starting a reply: claim it ourselves
            if existing.reply_id is None:
                break
            reply = await self.gw.store.get_reply(existing.reply_id)
            if reply is not None:
                return reply
            await guarded(idem.release(self.user, key))  # its conversation was deleted: start afresh
        raise ApiError(409, "A request with this idempotency key is still being started; retry shortly.",
                       param="X-Idempotency-Key", code="idempotency_key_in_use", headers={"Retry-After": "1"})

    async def on_final(self, reply_id: str, final: FinalEvent, model: str) -> None:
        """At the final event, before [DONE]: stop sharing the reply, mark the key complete (the
        accounting hook does both too, for replies nobody watched to the end), bill a follower."""
        if self.flight:
            await self.limits.flights.finish(self.flight, reply_id)
        if self.key:
            await self.limits.idempotency.complete(self.user, self.key)
        if self.follows:
            await self._bill_shared(reply_id, final, model)

    # -- single flight: a follower is a request of its own -------------------------------------

    async def follow(self, reply: Reply) -> bool:
        """Serve this request the leader's reply: reserve its tokens as its own request would
        (the prompt and max_tokens the reply was started with, on the model that serves it), and
        bill it however its response ends. False, reserving nothing, when its quota cannot hold
        them: it then runs as a request of its own (a mini pool or a 429, as any request gets)."""
        job = reply.job or {}
        context = job.get("context") or {}
        model = str(job.get("model") or self.body.model)
        tokens = int(context.get("prompt_tokens") or 0) + int(context.get("max_tokens") or 0)
        got = await guarded(self.limits.tokens.reserve(self.user, model, self.principal.tier, tokens))
        if isinstance(got, Denied):
            return False
        self.reservation, self.follows, self.followed = got, True, reply
        add_cleanup(self.request, self._bill_if_left)
        return True

    def left(self, chars: int) -> None:
        """The stream ended before the reply did (its client left), having sent this much text."""
        self.sent_chars = chars

    async def _bill_if_left(self) -> None:
        """After the response, a follower its reply's end never reached (its client left first) is
        billed for what it was sent: the prompt and the completion tokens of the text it got. As a
        leader that leaves early is billed for what its reply generated, which goes on for it to
        resume; a follower generated nothing, so what it left with is what it cost. (The leader's
        bill is the reply's: it neither gains nor loses by a follower.)"""
        if self.billed or self.followed is None:
            return
        reply = self.followed
        prompt = int(((reply.job or {}).get("context") or {}).get("prompt_tokens") or 0)
        completion = await self._tokens_sent(reply.id, self.sent_chars or 0)
        final = FinalEvent(0, FinishReason.ABORT, ReplyState.STOPPED, prompt, 0, completion)
        await finish_anyway(self._bill_shared(reply.id, final, str((reply.job or {}).get("model") or self.body.model)))

    async def _tokens_sent(self, reply_id: str, chars: int) -> int:
        """The completion tokens behind the first `chars` characters of the reply's text, from its
        token log (each token event carries its ids)."""
        if chars <= 0:
            return 0
        try:
            events = await self.gw.relay.log.read(reply_id, 0)
        except RelayError:
            log.warning("reply %s: its log is gone: a follower that left is billed its prompt only", reply_id)
            return 0
        tokens = seen = 0
        for event in events:
            if seen >= chars:
                break
            if isinstance(event, TokenEvent):
                seen += len(event.text)
                tokens += len(event.token_ids)
        return tokens

    async def _bill_shared(self, reply_id: str, final: FinalEvent, model: str) -> None:
        """Once: the follower's reservation settled to its usage (released for a failed reply)
        and its usage record written (usage/accounting.py). A store that fails here costs the
        bill, not the client's answer."""
        if self.billed:
            return
        self.billed = True
        if self.reservation is not None:
            try:
                if final.error is not None:
                    await self.limits.tokens.release(self.reservation)
                else:
                    await self.limits.tokens.settle(self.reservation, final.prompt_tokens + final.completion_tokens)
            except LimitsError:  # the reservation ages out of its window: over-counted, never under
                log.warning("reply %s: could not settle a shared request's tokens", reply_id, exc_info=True)
        if self.gw.accounting is None:
            return
        try:
            await self.gw.accounting.shared(reply_id, uuid.uuid4().hex[:16], self.user, self.principal.tier,
                                            model, final, time.monotonic() - self.started)
        except Exception:
            log.warning("reply %s: could not record a shared request's usage", reply_id, exc_info=True)


# The body is parsed by parse_chat and the headers read from the request, not by FastAPI: stated
# here for the schema.
_OPENAPI = {
    **BEARER_REQUIRED,
    "requestBody": request_body(ChatCompletionRequest),
    "parameters": [
        {"name": "X-Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "A resend with the same key attaches to the first request's reply."},
        {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "With an idempotency key: a duplicate streams the events after this id."},
        {"name": "X-Fairway-Region", "in": "header", "required": False,
         "schema": {"type": "string", "pattern": REGION.pattern},
         "description": "Serve in this region (a replica's --region). When it has no replica of the model, "
                        "another region serves and the response's X-Fairway-Region-Fallback header names it."},
    ],
}
# One server-sent event (as OpenAPI 3.2's itemSchema describes SSE): a chat.completion.chunk (or an
# error) as JSON in `data`, numbered by `id` for Last-Event-ID, and "[DONE]" at the end.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "event": {"type": "string"},
        "data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"type": "object", "anyOf": [{"required": ["object", "choices"]}, {"required": ["error"]}]}},
        ]},
    },
}
SSE_RESPONSE = {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                "description": "Server-sent events: one chat.completion.chunk per event (id: n), then [DONE]."}


# What a response says about how it is served (also when a free request met a pool at capacity).
SERVED_HEADERS = {
    "X-Fairway-Model": {"description": "The model that serves the reply (as the body's `model`): the requested "
                                       "one, or its mini pool's past a limit.", "schema": {"type": "string"}},
    "X-Fairway-Fallback": {"description": "Why the reply is not served as asked: `mini` (the model's pool was at "
                                          "capacity for a free request), `quota` (the user's quota for the model "
                                          "is spent: its mini pool serves), `shorten` (at capacity: fewer max "
                                          "tokens).", "schema": {"type": "string", "enum": ["mini", "quota", "shorten"]}},
    "X-Fairway-Max-Tokens": {"description": "The most tokens the reply may generate (fewer than asked under "
                                            "`shorten`); also the first chunk's `context.max_tokens`.",
                             "schema": {"type": "integer"}},
}
_ERRORS = error_responses(400, 401, 404, 409, 429, 503)
_ERRORS[400] = {**_ERRORS[400], "description": _ERRORS[400]["description"] + " Tool messages (code invalid_value, "
                "fairway/tools/results.py): each answers a call still waiting for its result, once (param "
                "`messages[i].tool_call_id`), and every call, the stored conversation's last reply's included, has "
                "its result before the next user or assistant message (param `messages[i].role`) and before the "
                "messages end (param `messages[i].tool_calls`, or `messages` for stored calls): \"An assistant "
                "message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. "
                "The following tool_call_ids did not have response messages: ...\"."}
_ERRORS[503] = {**_ERRORS[503], "description": _ERRORS[503]["description"] + " Code `shed`: a free request met its "
                "model's pool at capacity (predicted wait over the limit); its message is stored, its reply "
                "SHED, and Retry-After says when a place may be free.",
                "headers": {"Retry-After": {"schema": {"type": "integer"}}}}


@router.post("/v1/chat/completions", openapi_extra=_OPENAPI,
             responses={200: {**SSE_RESPONSE, "headers": SERVED_HEADERS,
                              "description": "A chat.completion (JSON), or with stream: true "
                                             "chat.completion.chunk events (SSE)."},
                        **_ERRORS})
async def chat_completions(request: Request) -> Any:
    """Counted once whatever it answers (fairway:chat_requests): a refusal by its status and code."""
    try:
        response, outcome = await _chat_completions(request)
    except ApiError as exc:
        metrics.CHAT_REQUESTS.labels(str(exc.status), exc.code or exc.type).inc()
        count_refusal(exc)
        raise
    metrics.CHAT_REQUESTS.labels("200", outcome).inc()
    return response


async def _chat_completions(request: Request) -> tuple[Any, str]:
    """The response, and how it is served: generated, shared, replayed or resumed."""
    principal = await authenticate(request)
    gw = gateway(request)
    data, body = parse_chat(await request.body())
    request.state.ratelimit_model = body.model
    edge = Edge(request, gw, principal, data, body)
    check_max_tokens(max_tokens_of(body), gw.limits.tokens.limit(principal.tier, body.model), body.model)
    key = _idempotency_key(request, body)
    turn_request = TurnRequest(
        user_id=principal.user_id,
        model=body.model,
        messages=chat_messages(body),
        sampling=sampling(body, gw.service.vocab_size(body.model)),
        conversation_id=body.conversation_id,
        client_key=_client_key(key),
        resume_only=body.last_received_token_index is not None,
        tier=principal.tier,
        admit=edge.admit_tokens,
        attachments=await _attached_files(gw, principal.user_id, body),
        tools=tool_set(body),
        region=_region(request) or principal.region,
    )
    after = body.last_received_token_index or 0
    if turn_request.resume_only and not turn_request.client_key:
        raise invalid("last_received_token_index needs the message_id (or X-Idempotency-Key) of the message "
                      "whose reply to resume.", "last_received_token_index")
    await edge.hit_request_rate()
    try:
        return await _admitted(request, gw, edge, turn_request, key, after)
    except ApiError as exc:
        if exc.status >= 500:
            # Refused for the service's own reasons (overloaded, shed, no replica, a failed reply):
            # the user did nothing that should use their requests-per-minute quota.
            await edge.refund_request()
        raise


async def _admitted(request: Request, gw: GatewayContext, edge: Edge, turn_request: TurnRequest, key: str | None,
                    after: int) -> tuple[Any, str]:
    """A request within its user's request rate, from the admission queue to its response."""
    body = edge.body
    await edge.admit_slot()

    extra_headers: dict[str, str] = {}
    turn: Turn | None = None
    reply: Reply | None = None
    if key and not turn_request.resume_only:
        reply = await edge.claim(key)
        if reply is not None:
            extra_headers["X-Idempotent-Replayed"] = "true"
            after = event_id(request.headers.get("last-event-id"))  # a duplicate attaches from where its client got to
        else:
            turn = await _start_claimed(gw, edge, turn_request)
    elif (not turn_request.resume_only and not body.conversation_id and turn_request.tools is None
          and is_cacheable(body.temperature, body.n)):
        # The attached files change the context (their chunks), so they are part of what is shared.
        edge.flight = flight_fingerprint(edge.user, body.model, turn_request.messages,
                                         files=turn_request.file_ids,
                                         **{k: v for k, v in turn_request.sampling.items() if k != "temperature"})
        turn, reply = await _start_shared(gw, edge, turn_request)
        if edge.follows:
            extra_headers["X-Shared-Generation"] = "true"
    else:
        turn = await _start(gw.service, turn_request)
    if turn is not None:
        reply = turn.reply
        if turn.region_fallback:
            extra_headers["X-Fairway-Region-Fallback"] = turn.region_fallback
    assert reply is not None
    set_ratelimit_headers(request, await edge.ratelimit_headers())

    served = str((reply.job or {}).get("model") or body.model)  # the mini pool's past a limit
    view = ReplyView.of(reply, served)
    headers = {**view.headers(), **extra_headers, "X-Fairway-Model": served}
    stored = (reply.job or {}).get("context")
    if stored:  # said by the request that built it and by every duplicate: identical streams
        # In a fixed order: PostgreSQL's JSONB does not keep the order it was given.
        context = {k: stored[k] for k in ("prompt_tokens", "dropped_turns", "dropped_messages", "max_tokens")}
        context.update({k: stored[k] for k in ("memories", "memory_ids", "sources", "fallback") if k in stored})
        view.first_extra = {"context": context}
        headers.update({"X-Context-Tokens": str(context["prompt_tokens"]),
                        "X-Context-Dropped-Turns": str(context["dropped_turns"]),
                        "X-Fairway-Max-Tokens": str(context["max_tokens"])})
        if "fallback" in context:
            headers["X-Fairway-Fallback"] = str(context["fallback"])

    async def on_final(final: FinalEvent) -> None:
        await edge.on_final(reply.id, final, served)

    outcome = ("resumed" if turn_request.resume_only else
               "replayed" if "X-Idempotent-Replayed" in extra_headers else
               "shared" if edge.follows else "generated")
    if not body.stream:
        return JSONResponse(await gw.relay.complete(reply, view, on_final), headers=headers), outcome
    await gw.relay.check_after(reply, after)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = gw.relay.sse(reply, view, after, include_usage, on_final, connection_of(request.scope),
                          edge.left if edge.follows else None)
    streams = metrics.ACTIVE_STREAMS.labels(body.model)
    streams.inc()
    add_cleanup(request, streams.dec)
    return EventStream(stream, headers={**SSE_HEADERS, **headers}), outcome


async def _start_claimed(gw: GatewayContext, edge: Edge, turn_request: TurnRequest) -> Turn:
    """Start the reply of a request that owns its idempotency key, and record it under the key
    (duplicates attach to it from then on); a failure frees the key for a retry."""
    assert edge.key is not None
    try:
        turn = await _start(gw.service, turn_request)
    except BaseException:
        with contextlib.suppress(Exception):  # (if this fails too, the key expires with its TTL)
            await gw.limits.idempotency.release(edge.user, edge.key)
        raise
    try:
        await gw.limits.idempotency.attach(edge.user, edge.key, turn.reply.id)
    except LimitsUnavailable as exc:
        # The reply runs, and is charged, whatever we answer: a 503 now would lose it to the client
        # and have it sent again. Unattached, the claim lapses (idempotency.claim_ttl_s).
        log.warning("reply %s: its idempotency key could not be recorded (%s)", turn.reply.id, exc)
    return turn


async def _start_shared(gw: GatewayContext, edge: Edge, turn_request: TurnRequest) -> tuple[Turn | None, Reply | None]:
    """Identical cacheable requests in flight share one generation: (our turn, None) when this
    request leads, (None, the leader's reply) when it follows."""
    assert edge.flight is not None
    started: list[Turn] = []

    async def start() -> str:
        turn = await _start(gw.service, turn_request)
        started.append(turn)
        return turn.reply.id

    flight = await guarded(gw.limits.flights.run(edge.flight, start))
    if started:
        return started[-1], None
    reply = await gw.store.get_reply(flight.reply_id)
    if reply is None:  # deleted meanwhile: run our own
        edge.flight = None
        return await _start(gw.service, turn_request), None
    edge.flight = None  # a follower does not finish the flight: the leader's reply does
    if not await edge.follow(reply):
        return await _start(gw.service, turn_request), None
    return None, reply


async def _attached_files(gw: GatewayContext, user: str, body: ChatCompletionRequest) -> dict[int, list[Attachment]]:
    """The files each user message attaches, by its index in messages, each the user's and ready
    (404 / 409 otherwise), as the message stores them."""
    by_message = file_ids(body)
    if not by_message:
        return {}
    if gw.files is None:
        raise unavailable("Files are off on this server.", "files_unavailable")
    found: dict[str, Attachment] = {}
    for file_id in (f for ids in by_message.values() for f in ids):
        if file_id in found:
            continue
        record = await gw.files.get(user, file_id)
        if record is None:
            raise not_found(f"No file {file_id!r}.", "file_id", "file_not_found")
        if record.status != "ready":
            detail = f": {record.status_details}" if record.status_details else ""
            raise ApiError(409, f"File {file_id!r} is {record.status}{detail}; attach it once it is ready.",
                           param="file_id", code="file_not_ready")
        found[file_id] = Attachment(file_id, record.filename, record.bytes, record.content_type)
    return {i: [found[f] for f in ids] for i, ids in by_message.items()}


def flagged_input(exc: InputFlagged) -> ApiError:
    """The input check's refusal: OpenAI's content_policy_violation, naming the categories; the
    headers say where the refused message is stored (status flagged)."""
    categories = exc.result.flagged_categories
    return ApiError(400, f"Your message was flagged by the content policy ({', '.join(categories)}) and was not "
                         "sent to the model.", param="messages", code="content_policy_violation",
                    headers={"X-Conversation-Id": exc.conversation_id, "X-Message-Id": exc.message_id,
                             "X-Flagged-Categories": ",".join(categories)})


def _region(request: Request) -> str | None:
    region = request.headers.get("x-fairway-region", "").strip()
    if region and not REGION.fullmatch(region):
        raise invalid("Invalid X-Fairway-Region: a region is 1 to 64 letters, digits, '.', '_' or '-', "
                      "starting with a letter or digit.", "X-Fairway-Region", "invalid_region")
    return region or None


def _idempotency_key(request: Request, body: ChatCompletionRequest) -> str | None:
    """The body's message_id, else the X-Idempotency-Key header; a bad one is a 400 naming the
    one the client sent."""
    key, param = body.message_id, "message_id"
    if key is None:
        key, param = request.headers.get("x-idempotency-key") or None, "X-Idempotency-Key"
    if key is not None:
        try:
            check_key(key)
        except ValueError as exc:
            raise invalid(f"Invalid {param}: {exc}.", param, "invalid_idempotency_key") from None
    return key


def _client_key(key: str | None) -> str | None:
    """The key as the message's client_key (a column of 128): longer keys by their hash."""
    if key is None or len(key) <= 128:
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


async def _start(service, turn_request: TurnRequest) -> Turn:
    try:
        return await guarded(service.start_turn(turn_request))
    except UnknownModel as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None
    except NothingToResume as exc:
        raise not_found(f"There is no reply to resume: {exc}.", "last_received_token_index",
                        "reply_not_found") from None
    except ConversationBusy as exc:
        raise ApiError(409, f"The conversation is still answering an earlier message (reply {exc.reply_id}). Send "
                       "the next message once that reply has ended, or stop it first (POST "
                       f"/v1/replies/{exc.reply_id}/stop).", param="conversation_id", code="conversation_busy",
                       headers={"X-Reply-Id": exc.reply_id or ""}) from None
    except NotFound:
        raise not_found(f"No conversation {turn_request.conversation_id!r}.", "conversation_id",
                        "conversation_not_found") from None
    except OverQuota as exc:  # the mini pool's quota spent too (the service raises the first model's itself)
        raise exc.error from None
    except ContextTooLong as exc:
        raise invalid(str(exc), "messages", "context_length_exceeded") from None
    except InputFlagged as exc:
        raise flagged_input(exc) from None
    except ToolUnavailable as exc:
        raise invalid(str(exc), "tools", "tool_unavailable") from None
    except ToolError as exc:  # against the stored conversation's waiting calls: a result for none, or one left without
        raise invalid(str(exc), exc.param, "invalid_value") from None
    except NoReplica as exc:
        raise ApiError(503, str(exc), code="no_replica", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except Shed as exc:
        shed = {"Retry-After": str(exc.retry_after_s), "X-Conversation-Id": exc.conversation_id}
        if exc.reply_id:
            shed.update({"X-Message-Id": exc.message_id or "", "X-Reply-Id": exc.reply_id})
        raise ApiError(503, str(exc), code="shed", type="server_error", headers=shed) from None
    except RelayUnavailable as exc:
        raise unavailable(f"The token log is unavailable: {exc}", "relay_unavailable") from None

