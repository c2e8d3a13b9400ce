"""The conversation service: turns a chat request into a running reply.

It finds or creates the conversation, checks the new user message (fairway/safety/: a flagged
one is stored with status flagged and refused, before routing, with no tokens reserved), builds
the context (context_builder.py), stores the user message before generation starts, asks the
router for a replica, opens the reply's token log and
submits the job. A resent message (same client key) attaches to the reply already running for
it instead of starting a second one. The gateway only speaks HTTP around this.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fairway.conversation.context_builder import (
    ChatMessage,
    ChatTokenizer,
    Context,
    ContextBuilder,
    ContextTooLong,
    reply_max_tokens,
)
from fairway.conversation.entities import (
    Attachment,
    Conversation,
    Message,
    MessageStatus,
    Reply,
    Role,
    new_id,
    now,
)
from fairway.conversation.extras import ContextSource, TurnExtras, TurnInfo
from fairway.conversation.launched import LaunchedReplies
from fairway.conversation.store import (
    ConversationStore,
    DuplicateClientKey,
    NewTurn,
    NotFound,
    ReplyFinished,
    StoreUnavailable,
)
from fairway.domain import FinishReason, Lane, ReplyState, Tier, lane_of_tier
from fairway.relay import Relay, RelayError
from fairway.replica.job import GenerationJob
from fairway.replica.registry import ReplicaInfo
from fairway.router import NoReplica, Router, region_fallback
from fairway.safety import ModerationResult, Moderator
from fairway.tools import ToolSet
from fairway.tools.prompt import expand_assistant, prompt_messages, system_block
from fairway.tools.results import check_results, waiting_calls
from fairway.usage import metrics

log = logging.getLogger(__name__)

# A reply stored this long ago with no token log has lost it (a launch follows its store at once),
# and a sweep looks for such replies this often.
LOST_AFTER_S = 5.0
LOST_POLL_S = 30.0
LOST_CHECK_BATCH = 500  # unfinished replies whose logs one round trip looks for

# A new message as the store takes it (NewTurn.messages): role, text, tools, attached files.
StoredMessage = tuple[Role, str, dict[str, Any] | None, Sequence[Attachment]]


class NothingToResume(NotFound):
    """A resume (last_received_token_index) for a message that has no reply."""


class InputFlagged(Exception):
    """The input check flagged the new user message: it is stored (status flagged), not answered."""

    def __init__(self, result: ModerationResult, conversation_id: str, message_id: str) -> None:
        super().__init__(f"the message was flagged: {', '.join(result.flagged_categories)}")
        self.result = result
        self.conversation_id = conversation_id
        self.message_id = message_id


class ToolUnavailable(Exception):
    """The request asks for execute_code and no replica of the model can run code: why."""


class UnknownModel(LookupError):
    def __init__(self, model: str, known: Sequence[str]) -> None:
        super().__init__(f"The model '{model}' does not exist. Available: {', '.join(sorted(known)) or 'none'}")
        self.model = model


@dataclass
class ServiceSettings:
    default_max_tokens: int = 512  # when the request sets none
    default_tier: str = Tier.FREE.value  # for requests that name no tier
    max_tool_rounds: int = 5  # tool runs per reply; then it ends, saying so


@dataclass
class TurnRequest:
    """A validated chat request, as the gateway hands it over."""

    user_id: str
    model: str
    messages: list[ChatMessage]  # {"role": system|user|assistant, "content": str}
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields, max_tokens optional
    conversation_id: str | None = None
    client_key: str | None = None  # the client's message id (or idempotency key)
    resume_only: bool = False  # attach to the message's running reply; never start one
    tier: str | None = None  # the user's tier (from their key): the conversation's lane
    # The files each user message attaches, by its index in messages (stored with it).
    attachments: dict[int, list[Attachment]] = field(default_factory=dict)
    tools: ToolSet | None = None  # what the reply may call (None: no tools)
    region: str | None = None  # the region the request asked to be served in (X-Fairway-Region)
    # Called once the context is built, before anything is stored, with (the model that will
    # serve, prompt tokens, max_tokens): the gateway reserves tokens here, and may refuse by
    # raising (OverQuota: the user's quota for that model is spent; the mini pool may serve).
    admit: Callable[[str, int, int], Awaitable[Admitted]] | None = None

    @property
    def file_ids(self) -> list[str]:
        """The files the request attaches, in order, once each: what the turn retrieves from."""
        return list(dict.fromkeys(a.file_id for i in sorted(self.attachments) for a in self.attachments[i]))


class OverQuota(Exception):
    """Raised by admit(): the user's token quota for the model is spent. `error` is the refusal
    to raise when no mini pool serves the request instead."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Shed(Exception):
    """A free request refused at capacity: its message is stored, its reply SHED (both None
    when another copy of the same message was stored first)."""

    def __init__(self, retry_after_s: int, conversation_id: str, message_id: str | None,
                 reply_id: str | None) -> None:
        super().__init__("The service is at capacity for free requests right now; retry in "
                         f"{retry_after_s} s, or use a paid key.")
        self.retry_after_s = retry_after_s
        self.conversation_id = conversation_id
        self.message_id = message_id
        self.reply_id = reply_id


class Admitted:
    """What admit() returns: `meta` is stored with the reply's job (settled when it ends);
    release() undoes the admission when no reply gets started after all."""

    def __init__(self, meta: dict[str, Any] | None = None,
                 release: Callable[[], Awaitable[None]] | None = None) -> None:
        self.meta = meta or {}
        self._release = release
        self.released = False

    async def release(self) -> None:
        if not self.released and self._release is not None:
            self.released = True
            await self._release()


@dataclass
class _Start:
    """A new turn on its way to a replica: what start_turn found, and how pressure changed it."""

    req: TurnRequest
    conversation: Conversation | None
    stored: list[Message]
    new: list[ChatMessage]
    to_store: list[StoredMessage]  # the new messages as the store takes them (with their files)
    lane: Lane
    shed_before: Message | None = None
    model: str = ""  # the model that serves it: the requested one, or its mini pool's
    treated: str = ""  # "", or why it is served otherwise: shorten, mini (capacity), quota
    max_tokens_cap: int | None = None

    def __post_init__(self) -> None:
        self.model = self.model or self.req.model


@dataclass
class Turn:
    conversation: Conversation
    message: Message  # the user message the reply answers
    reply: Reply
    context: Context | None  # None when the request attached to an existing reply
    max_tokens: int = 0
    region_fallback: str | None = None  # the region that served, when not the one requested

    @property
    def attached(self) -> bool:
        return self.context is None


class ConversationService:
    def __init__(
        self,
        store: ConversationStore,
        relay: Relay,
        router: Router,
        tokenizers: dict[str, ChatTokenizer],
        settings: ServiceSettings | None = None,
        sources: Sequence[ContextSource] = (),
        moderator: Moderator | None = None,
        launched: LaunchedReplies | None = None,
    ) -> None:
        self.store = store
        self.launched = LaunchedReplies() if launched is None else launched  # what this process's recorder need not read back
        self.relay = relay
        self.sources = list(sources)  # memories, file chunks: what else goes into a context
        self.moderator = moderator  # the input check; None: none
        self.router = router
        self.tokenizers = tokenizers  # model name -> its tokenizer: the models this gateway serves
        self.settings = settings or ServiceSettings()
        self._builders: dict[tuple[str, int], ContextBuilder] = {}

    # -- models ------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.tokenizers:
            raise UnknownModel(model, list(self.tokenizers))

    def vocab_size(self, model: str) -> int | None:
        """The size of the model's vocabulary (its tokenizer's); None for a model this gateway does
        not serve (start_turn refuses it)."""
        tokenizer = self.tokenizers.get(model)
        return None if tokenizer is None else tokenizer.vocab_size

    async def served_models(self) -> list[str]:
        """Models this gateway can tokenize and some live replica serves."""
        live = {r.model for r in await self.router.live()}
        return sorted(m for m in self.tokenizers if m in live)

    def _builder(self, model: str, window: int) -> ContextBuilder:
        key = (model, window)
        if key not in self._builders:
            self._builders[key] = ContextBuilder(self.tokenizers[model], window)
        return self._builders[key]

    # -- a new turn --------------------------------------------------------------------------

    async def start_turn(self, req: TurnRequest) -> Turn:
        """Store the message and start its reply, or attach to the reply already started for it.

        A free request whose model's pool is at capacity is treated as configured
        (fairway/router/pressure.py): shed (Shed raised, the reply stored SHED), served by the
        mini pool, or with fewer max tokens; one whose user's quota for the model is spent
        (admit raised OverQuota) is served by the mini pool when one runs.

        Raises UnknownModel, NotFound (conversation), ToolError (a tool result for no waiting call,
        or a message while calls wait), InputFlagged, ContextTooLong, NoReplica, Shed."""
        self.check_model(req.model)
        if req.resume_only:
            return await self._resume(req)
        conversation, stored = await self._find_conversation(req)
        shed_before: Message | None = None  # a resent message whose earlier reply was shed: answered now
        if conversation is not None and req.client_key:
            turn = await self._existing_turn(conversation, req.client_key)
            if turn is not None and turn.reply.state != ReplyState.SHED:
                return turn
            if turn is not None:
                shed_before = turn.message  # stored with what came before it: the context is the store's
        kept = _new_messages(req.messages, stored) if shed_before is None else []
        new = [req.messages[i] for i in kept]
        to_store = [_stored(req.messages[i], req.attachments.get(i, ())) for i in kept]
        if shed_before is None:  # each tool result answers a waiting call, and none is left waiting (else ToolError)
            check_results(req.messages, waiting_calls([(m.role, m.tools) for m in stored
                                                       if m.status != MessageStatus.FLAGGED]))
        if self.moderator is not None and shed_before is None:
            await self._check_input(req, conversation, new, to_store)
        lane = lane_of_tier(conversation.tier if conversation else req.tier or self.settings.default_tier)
        start = _Start(req, conversation, stored, new, to_store, lane, shed_before)
        pressure = await self.router.pressure(req.model, lane) if lane == Lane.FREE else None
        if pressure is not None and pressure.at_capacity:
            treatment = self.router.settings.pressure.free_at_capacity
            mini = await self._mini(req) if treatment == "mini" else None
            metrics.FREE_AT_CAPACITY.labels(req.model, treatment if treatment != "mini" or mini else "shed").inc()
            if treatment == "shorten":
                start.max_tokens_cap = self.router.settings.pressure.shorter_max_tokens
                start.treated = "shorten"
            elif mini is not None:
                start.model, start.treated = mini, "mini"
            else:  # shed (or mini with no mini pool running)
                await self._shed(start, pressure.retry_after_s)
        try:
            return await self._start_on(start)
        except OverQuota as over:
            mini = await self._mini(req) if self.router.settings.pressure.mini_past_quota else None
            if mini is None or start.model == mini:
                raise over.error from None
            start.model, start.treated, start.max_tokens_cap = mini, "quota", None
            return await self._start_on(start)

    async def _mini(self, req: TurnRequest) -> str | None:
        """The model's mini pool, when a replica of it runs, this gateway can tokenize for it, and
        the request means the same there. A logit_bias names token ids of the requested model's
        vocabulary (the gateway checked them against it), which another tokenizer may lack or
        spell otherwise: biased there, it would push other tokens, or fail the reply. Such a
        request stays with its model (shed at capacity, 429 past its quota, as when no mini pool
        runs) unless the mini model's tokens at those ids are the same."""
        mini = await self.router.mini_pool(req.model)
        if mini not in self.tokenizers:
            return None
        ours, theirs = self.tokenizers[req.model], self.tokenizers[mini]
        biased = [int(token) for token in req.sampling.get("logit_bias") or {}]
        if any(t >= theirs.vocab_size or theirs.id_to_token(t) != ours.id_to_token(t) for t in biased):
            return None
        return mini

    async def _shed(self, start: _Start, retry_after_s: int) -> None:
        """Refuse a free request at capacity: its message is stored, answered by a SHED reply."""
        req, conversation = start.req, start.conversation
        new_conversation = conversation is None
        conversation = conversation or self._new_conversation(req)
        job = {"model": req.model, "lane": start.lane.value, "tier": conversation.tier}
        try:
            if start.shed_before is not None:
                message = start.shed_before
                reply = await self.store.add_reply(conversation.id, message.id, None, None, job, shed=True)
            else:
                message, reply = await self.store.store_turn(NewTurn(
                    conversation, new_conversation, start.to_store, req.client_key, job=job,
                    shed=True))
            assert reply is not None
        except DuplicateClientKey:  # the same message raced in twice: the other one is answered
            raise Shed(retry_after_s, conversation.id, None, None) from None
        raise Shed(retry_after_s, conversation.id, message.id, reply.id)

    async def _start_on(self, start: _Start) -> Turn:
        req, conversation, model = start.req, start.conversation, start.model
        replicas = await self._replicas(model)
        if req.tools is not None and req.tools.code and all(r.sandbox_off for r in replicas):
            raise ToolUnavailable(f"Code execution is off on this server: {replicas[0].sandbox_off}.")
        window = min(r.max_model_len for r in replicas)
        max_tokens = int(req.sampling.get("max_tokens") or reply_max_tokens(self.settings.default_max_tokens, window))
        if start.max_tokens_cap is not None:
            max_tokens = min(max_tokens, start.max_tokens_cap)
        new_conversation = conversation is None
        conversation = conversation or self._new_conversation(req)  # stored only once the reply can run
        extras = await self._extras(req, model, conversation, new_conversation, start.new)
        context = self._build(model, window, start.stored, start.new, max_tokens, extras, req.tools)
        longest = min(r.max_prompt_tokens for r in replicas)
        if context.num_tokens > longest:
            raise ContextTooLong(context.num_tokens, longest, window, max_tokens)
        admitted = await req.admit(model, context.num_tokens, max_tokens) if req.admit else Admitted()
        try:
            job = GenerationJob(
                reply_id="",
                model=model,
                prompt_token_ids=context.prompt_token_ids,
                sampling={**req.sampling, "max_tokens": max_tokens},
                lane=start.lane.value,
                tier=conversation.tier,
                tools=({**req.tools.to_dict(), "max_rounds": self.settings.max_tool_rounds}
                       if req.tools is not None else {}),
                tenant=req.user_id,
            )
            info = {"prompt_tokens": context.num_tokens, "dropped_turns": context.dropped_turns,
                    "dropped_messages": context.dropped_messages, "max_tokens": max_tokens, **extras.info}
            if start.treated:
                info["fallback"] = start.treated  # why it is served so: the response says it
            replica = await self.router.place(job.model, context.prompt_token_ids, req.region, start.lane)
            try:
                if start.shed_before is not None:
                    message = start.shed_before
                    reply = await self.store.add_reply(conversation.id, message.id, job.prompt_token_ids,
                                                       replica.id, _stored_job(job, admitted.meta, info))
                else:
                    message, reply = await self.store.store_turn(NewTurn(
                        conversation, new_conversation, start.to_store, req.client_key,
                        job.prompt_token_ids, replica.id, _stored_job(job, admitted.meta, info)))
                assert reply is not None
            except DuplicateClientKey as dup:  # the same message raced in twice: one reply for both
                if new_conversation:  # the stored one: the other request's
                    conversation = await self.store.get_conversation(conversation.id, req.user_id) or conversation
                turn = await self._existing_turn(conversation, dup.existing.client_key or "")
                if turn is None:
                    raise
                await admitted.release()
                return turn
            await self._launch(reply, job, replica)
        except BaseException:
            with contextlib.suppress(Exception):  # the original error is the one to report
                await admitted.release()
            raise
        return Turn(conversation, message, reply, context, max_tokens, region_fallback(req.region, replica))

    async def _check_input(self, req: TurnRequest, conversation: Conversation | None,
                           new: list[ChatMessage], to_store: list[StoredMessage]) -> None:
        """Classify the request's new user messages (only they: the stored history was checked
        when it was new; usually one, but a client may send history the store has not seen) and,
        if any is flagged, store the turn flagged (each flagged message with its own categories,
        the last one flagged too, as nothing answers it, with only its own: the user's usage counts
        each category where it was found, once) and raise InputFlagged, naming all of them."""
        assert self.moderator is not None
        users = [i for i, m in enumerate(new) if m["role"] == "user"]
        if not users:  # a turn of tool results only: no new words of the user's to check
            return
        results = await self.moderator.moderate([new[i]["content"] for i in users], "input")
        if not any(r.flagged for r in results):
            return
        result = self.moderator.combined(results)
        new_conversation = conversation is None
        conversation = conversation or self._new_conversation(req)
        own = {i: r.flagged_categories for i, r in zip(users, results, strict=True) if r.flagged}
        last = own.pop(len(new) - 1, [])
        try:
            message, _ = await self.store.store_turn(NewTurn(
                conversation, new_conversation, to_store, req.client_key, flagged=True,
                flagged_categories=last, flagged_earlier=own))
        except DuplicateClientKey as dup:  # the same refused message, sent again
            message = dup.existing
        raise InputFlagged(result, conversation.id, message.id)

    async def _find_conversation(self, req: TurnRequest) -> tuple[Conversation | None, list[Message]]:
        """The named conversation (NotFound if it is not the user's), or, with no name, the one a
        client key started earlier; None for a new conversation."""
        conv_id = req.conversation_id or (_derived_id(req.user_id, req.client_key) if req.client_key else None)
        conversation = await self.store.get_conversation(conv_id, req.user_id) if conv_id else None
        if conversation is None:
            if req.conversation_id:
                raise NotFound(f"conversation {req.conversation_id}")
            return None, []
        return conversation, await self.store.list_messages(conversation.id)

    def _new_conversation(self, req: TurnRequest) -> Conversation:
        """A conversation to store with the turn. With a client key its id derives from it, so
        re-sending the same request (no conversation_id yet) finds this conversation, and with it
        the running reply."""
        conv_id = _derived_id(req.user_id, req.client_key) if req.client_key else new_id("conv")
        title = next((m["content"] for m in req.messages if m["role"] == "user"), "")[:80]
        ts = now()
        return Conversation(conv_id, req.user_id, req.tier or self.settings.default_tier, req.model, title, ts, ts)

    async def _resume(self, req: TurnRequest) -> Turn:
        conversation, _ = await self._find_conversation(req)
        turn = await self._existing_turn(conversation, req.client_key) if conversation and req.client_key else None
        if turn is None:
            raise NothingToResume(f"no reply to message {req.client_key!r} to resume")
        return turn

    async def _existing_turn(self, conversation: Conversation, client_key: str) -> Turn | None:
        message = await self.store.get_message_by_client_key(conversation.id, client_key)
        if message is None:
            return None
        reply = await self.store.get_reply_for_message(conversation.id, message.id)
        if reply is None:
            return None
        return Turn(conversation, message, reply, None)

    async def _replicas(self, model: str) -> list[ReplicaInfo]:
        return await self.router.serving(model)  # raises NoReplica after a fresh look

    async def _extras(self, req: TurnRequest, model: str, conversation: Conversation, new_conversation: bool,
                      new: list[ChatMessage]) -> TurnExtras:
        """What the context sources add to this turn (memories, file chunks)."""
        extras = TurnExtras()
        if not self.sources:
            return extras
        question = next((m["content"] for m in reversed(new) if m["role"] == "user"), "")
        tokenizer = self.tokenizers[model]
        info = TurnInfo(req.user_id, conversation.id, new_conversation, question, list(req.file_ids),
                        lambda text: len(tokenizer.encode(text)))
        for source in self.sources:
            extras.add(await source.extras(info))
        return extras

    def _build(
        self, model: str, window: int, stored: list[Message], new: list[ChatMessage], max_tokens: int,
        extras: TurnExtras | None = None, tools: ToolSet | None = None,
    ) -> Context:
        """Stored history and the request's messages (an OpenAI client sends its whole history in
        a new conversation) as system text, older turns that may be dropped, and the new turn.
        Tools go to a template that renders them, else into a system block after the
        conversation's own system text (fairway/tools/prompt.py); calls and results stay where
        they were made."""
        messages = [m for s in stored if s.status != MessageStatus.FLAGGED for m in _chat(s)] + new
        # System text leads the context only while it leads the conversation; a system message
        # sent later stays where it was said.
        lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        system, history, turn = messages[:lead], messages[lead:last_user], messages[last_user:]
        native = bool(getattr(self.tokenizers[model], "supports_tools", False))
        if tools is not None and not native:
            system = [*system, {"role": "system", "content": system_block(tools)}]
        offered = [t.to_openai() for t in tools.offered] if tools is not None and native else None
        extras = extras or TurnExtras()
        return self._builder(model, window).build(system, history, turn, max_tokens, extras.head, extras.retrieved,
                                                  offered, lambda messages: prompt_messages(messages, native))

    async def _launch(self, reply: Reply, job: GenerationJob, replica: ReplicaInfo) -> None:
        """Open the reply's token log and hand its job to the replica."""
        job.submitted_at = time.time()
        job.reply_id = reply.id
        if reply.job:
            self.launched.add(reply.id, reply.job)
        await self.relay.launch(reply.id, job.to_dict(), job.lane, queue=replica.queue)

    # -- existing replies --------------------------------------------------------------------

    async def reply_for_user(self, reply_id: str, user_id: str) -> Reply:
        """The reply, if it belongs to one of the user's conversations (NotFound otherwise)."""
        reply = await self.store.get_reply(reply_id)
        if reply is None or await self.store.get_conversation(reply.conversation_id, user_id) is None:
            raise NotFound(f"reply {reply_id}")
        return reply

    async def restart_lost(self, min_age_s: float = LOST_AFTER_S) -> tuple[int, int]:
        """Run again every unfinished reply whose token log is gone, stored at least min_age_s ago
        (a younger one may be between its store and its launch): the process that held its log
        ended (fairway serve restarted) or Redis lost it. Without this a reply nobody reads again
        stays running for good, and its conversation busy. One stored longer ago than a log lives
        (a server restarted after a day down) is stopped instead, with no text: no client waits
        for it any more, and running all of them again would keep the replicas busy at start.
        How many were restarted, and how many wait for a replica of their model (a deployment's
        replicas start alongside its gateways)."""
        restarted = unplaced = 0
        now = time.time()
        unfinished = await self.store.unfinished_reply_ids(created_before=now - min_age_s)
        lost: list[str] = []
        for at in range(0, len(unfinished), LOST_CHECK_BATCH):  # one round trip a batch
            batch = unfinished[at:at + LOST_CHECK_BATCH]
            lost += [r for r, found in zip(batch, await self.relay.log.exists_many(batch), strict=True) if not found]
        for reply_id in lost:
            if (reply := await self.store.get_reply(reply_id)) is None:
                continue
            if reply.created_at < now - self.relay.log.ttl_s:
                await self.stop_lost(reply)
                continue
            try:
                restarted += await self.restart(reply)
            except NoReplica:
                unplaced += 1
        return restarted, unplaced

    async def stop_lost(self, reply: Reply) -> None:
        """End an unfinished reply nothing produces, and whose log is gone, as stopped with no
        text (what was said went with the log), freeing its conversation."""
        if reply.finished:
            return
        with contextlib.suppress(ReplyFinished, NotFound):  # (or it ended just now)
            await self.store.finish_reply(reply.id, "", MessageStatus.STOPPED, FinishReason.STOP.value,
                                          last_event_id=reply.last_event_id, look_up_existing=False)

    async def watch_lost(self, poll_s: float = LOST_POLL_S) -> None:
        """restart_lost() at start, then every poll_s, for the app's lifetime; sooner while lost
        replies wait for a replica."""
        wait_s = 1.0
        while True:
            try:
                restarted, unplaced = await self.restart_lost()
                if restarted:
                    log.warning("ran %d replies again whose token logs were lost", restarted)
                wait_s = min(wait_s * 2, poll_s) if unplaced else poll_s
            except (StoreUnavailable, RelayError) as exc:
                log.warning("could not look for replies whose token logs were lost: %s", exc)
            await asyncio.sleep(wait_s)

    async def restart(self, reply: Reply) -> bool:
        """Run an unfinished reply whose token log was lost again from its stored context, counted
        in reply.restarts. False if another gateway restarted it first (or it ended meanwhile)."""
        if reply.finished or reply.prompt_token_ids is None or not reply.job:
            return False
        job = GenerationJob.from_dict({**reply.job, "reply_id": reply.id, "prompt_token_ids": reply.prompt_token_ids})
        job.submitted_at = time.time()
        replica = await self.router.place(job.model)
        # Counted before the log is made: a gateway that dies in between leaves a count and no
        # log, and the next reader restarts it again; never a new log its clients' ids would
        # mistake for the lost one (gateway/cursor.py).
        claimed = await self.store.claim_restart(reply.id, reply.restarts, replica.id)
        if claimed is None:
            return False
        # The log says which run it holds: a reader that read the row before this claim (run k)
        # is told its log is gone rather than handed this run's events as run k's.
        if not await self.relay.log.create(reply.id, run=claimed.restarts):
            return False
        job.run = claimed.restarts  # its appends: a replica still running an earlier run cannot write here
        await self.relay.jobs.submit(job.to_dict(), job.lane, queue=replica.queue, front=True)
        return True


def _stored_job(job: GenerationJob, meta: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """The job as the reply keeps it (its prompt is a column of its own): enough to run it again."""
    stored = {k: v for k, v in job.to_dict().items() if k not in ("reply_id", "prompt_token_ids", "submitted_at")}
    stored["context"] = context  # what the response says about the context, to every duplicate too
    if meta:
        stored["meta"] = meta  # the gateway's, for when the reply ends (the replica never sees it)
    return stored


def _chat(message: Message) -> list[ChatMessage]:
    """A stored message as the chat messages it stands for: an assistant's with tool rounds is
    each call and its result, in the order they were made (fairway/tools/prompt.py)."""
    tools = message.tools or {}
    if message.role == Role.ASSISTANT and tools.get("calls"):
        return expand_assistant(message.text, tools["calls"])
    if message.role == Role.TOOL:
        return [{"role": "tool", "content": message.text, "tool_call_id": tools.get("tool_call_id", "")}]
    return [{"role": str(message.role), "content": message.text}]


def _stored(message: ChatMessage, attachments: Sequence[Attachment] = ()) -> StoredMessage:
    """A request's message as the store keeps it: its tool calls (or the call a result answers)
    in the tools column, each client call at the end of the text; a user message with the files
    it attaches."""
    if message.get("tool_calls"):
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                  "status": "call", "index": i, "at": len(message["content"])}
                 for i, c in enumerate(message["tool_calls"])]
        return Role(message["role"]), message["content"], {"calls": calls}, ()
    if message["role"] == "tool":
        return Role.TOOL, message["content"], {"tool_call_id": message.get("tool_call_id", "")}, ()
    return Role(message["role"]), message["content"], None, attachments


def _new_messages(messages: list[ChatMessage], stored: list[Message]) -> list[int]:
    """The indexes of the request's messages minus system text the conversation already has
    (clients that keep re-sending their system prompt would otherwise repeat it every turn)."""
    known = {m.text for m in stored if m.role == Role.SYSTEM}
    return [i for i, m in enumerate(messages) if not (m["role"] == "system" and m["content"] in known)]


def _derived_id(user_id: str, client_key: str) -> str:
    digest = hashlib.sha256(f"{user_id}\0{client_key}".encode()).hexdigest()[:32]
    return f"conv_{digest}"
