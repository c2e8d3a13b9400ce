"""The user's stored conversations: list, read (messages with their status), delete."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from fairway.conversation import Attachment, Conversation, Message, Role
from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated, user_id
from fairway.gateway.errors import error_responses, not_found
from fairway.gateway.replies import reply_context
from fairway.tools.prompt import openai_call
from fairway.tools.record import client_run

router = APIRouter(dependencies=[Depends(authenticated)], responses=error_responses(401, 503))


def _conversation(c: Conversation) -> dict[str, Any]:
    return {"id": c.id, "object": "conversation", "title": c.title, "model": c.model, "tier": c.tier,
            "created_at": c.created_at, "updated_at": c.updated_at}


class AttachmentOut(BaseModel):
    """A file the user message attached, as it was when sent."""

    file_id: str
    filename: str
    bytes: int
    content_type: str
    deleted: bool = Field(description="The file was deleted since: it is no longer in /v1/files, nor retrieved from.")


class ConversationMessageOut(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls, usage, context...: as the message has them

    id: str
    object: str = "conversation.message"
    role: str
    content: str
    status: str
    created_at: float
    attachments: list[AttachmentOut] | None = Field(
        None, description="A user message's attached files, in the order it attached them (empty when none); "
                          "absent on other roles' messages.")


class ConversationOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "conversation"
    title: str
    model: str
    tier: str
    created_at: float
    updated_at: float
    messages: list[ConversationMessageOut]


def _attachment(a: Attachment, kept: Collection[str] | None) -> dict[str, Any]:
    # A file deleted since stays listed, by name, and says so, rather than vanishing: the message
    # did carry it (its answer may cite it), and a shorter list would misstate what was sent.
    # kept is None when files are off on this server: nothing says any was deleted.
    return {"file_id": a.file_id, "filename": a.filename, "bytes": a.bytes, "content_type": a.content_type,
            "deleted": kept is not None and a.file_id not in kept}


def _message(m: Message, job: dict[str, Any] | None = None, finish_reason: str | None = None,
             kept: Collection[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": m.id, "object": "conversation.message", "role": str(m.role), "content": m.text,
                           "status": str(m.status), "created_at": m.created_at}
    if m.role == Role.USER:
        out["attachments"] = [_attachment(a, kept) for a in m.attachments or ()]
    if m.flagged_categories:
        out["flagged_categories"] = list(m.flagged_categories)
    tools = m.tools or {}
    calls = tools.get("calls") or []
    if any(c.get("status") == "call" for c in calls):
        out["tool_calls"] = [openai_call(c["id"], c["name"], c.get("arguments", "")) for c in calls
                             if c.get("status") == "call"]
    runs = [c for c in calls if c.get("status") != "call"]
    if runs:  # the built-in tool's runs, each at the offset in the content where it was made
        out["tool_executions"] = [client_run(r) for r in runs]  # the streamed chunk's names (result)
    if tools.get("tool_call_id"):
        out["tool_call_id"] = tools["tool_call_id"]
    if m.client_key:
        out["client_key"] = m.client_key
    if m.reply_id:
        out["reply_id"] = m.reply_id
        if finish_reason:
            out["finish_reason"] = finish_reason
        if context := reply_context(job):  # the files' chunks it was given (sources), its memories
            out["context"] = context
        out["usage"] = {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens,
                        "total_tokens": m.prompt_tokens + m.completion_tokens,
                        "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}
    return out


@router.get("/v1/conversations", responses=error_responses(400))
async def list_conversations(
    request: Request, limit: int = Query(20, ge=1, le=100), before: float | None = Query(None, allow_inf_nan=False)
) -> dict[str, Any]:
    """Newest activity first; pass the last one's updated_at as `before` for the next page."""
    found = await gateway(request).store.list_conversations(user_id(request), limit + 1, before)
    return {"object": "list", "data": [_conversation(c) for c in found[:limit]], "has_more": len(found) > limit}


@router.get("/v1/conversations/{conversation_id}",
            responses={200: {"model": ConversationOut, "description": "The conversation with its messages, oldest "
                             "first: each user message with the files it attached."}, **error_responses(404)})
async def get_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    state = gateway(request)
    store = state.store
    conversation = await store.get_conversation(conversation_id, user_id(request))
    if conversation is None:
        raise not_found(f"No conversation {conversation_id!r}.", "conversation_id", "conversation_not_found")
    messages = await store.list_messages(conversation.id)
    attached = {a.file_id for m in messages for a in m.attachments or ()}
    kept = await state.files.existing(conversation.user_id, attached) if state.files is not None else None
    jobs = await store.get_reply_jobs([m.reply_id for m in messages if m.reply_id])
    # The status alone does not say why a reply ended: one cut off by max_tokens (length) is
    # stored complete, as is one that ended by itself (stop).
    endings = await store.get_finish_reasons([m.reply_id for m in messages if m.reply_id])
    return {**_conversation(conversation),
            "messages": [_message(m, jobs.get(m.reply_id or ""), endings.get(m.reply_id or ""), kept)
                         for m in messages]}


@router.delete("/v1/conversations/{conversation_id}", responses=error_responses(404))
async def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    state = gateway(request)
    if not await state.store.delete_conversation(conversation_id, user_id(request)):
        raise not_found(f"No conversation {conversation_id!r}.", "conversation_id", "conversation_not_found")
    # What memory and files keep per conversation goes with it (its attached chunks, its block).
    if state.files is not None:
        await state.files.forget_conversation(conversation_id)
    if state.memory is not None:
        await state.memory.store.forget_conversation(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
