"""The user's memory (seed 002 §2.3): list facts, delete one or all, turn memory on or off, and
extract a conversation's facts now instead of when it goes idle."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated, user_id
from fairway.gateway.errors import ApiError, error_responses, not_found
from fairway.memory import MemoryService, readable

router = APIRouter(dependencies=[Depends(authenticated)])


class MemorySettingsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # enabled is a JSON boolean, not 0 or "yes"
    enabled: bool


class ExtractBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    conversation_id: str
    use_model: bool = True  # false: the explicit statements only, without waiting for the model


def _memory(request: Request) -> MemoryService:
    gw = gateway(request)
    if gw.memory is None:
        raise ApiError(503, f"Memory is off on this server: {gw.memory_off_reason or 'not configured'}.",
                       code="memory_unavailable")
    return gw.memory


@router.get("/v1/user/memory", responses=error_responses(401, 503))
async def list_memory(request: Request) -> dict[str, Any]:
    """The user's memories, oldest first, and whether memory is on for them."""
    memory = _memory(request)
    user = user_id(request)
    return {"memories": [m.public() for m in await memory.list(user)], "enabled": await memory.store.enabled(user)}


@router.delete("/v1/user/memory/{memory_id}", responses=error_responses(401, 404, 503))
async def delete_memory(memory_id: str, request: Request) -> dict[str, Any]:
    """Forget one memory: never injected again. 404 for an unknown id or another user's."""
    if not await _memory(request).forget(user_id(request), memory_id):
        raise not_found(f"No memory {memory_id!r}.", "memory_id", "memory_not_found")
    return {"memory_id": memory_id, "object": "memory.deleted", "deleted": True}


@router.delete("/v1/user/memory", responses=error_responses(401, 503))
async def delete_all_memory(request: Request) -> dict[str, Any]:
    return {"object": "memory.deleted", "deleted": await _memory(request).forget_all(user_id(request))}


@router.put("/v1/user/memory/settings", responses=error_responses(401, 400, 503))
async def memory_settings(body: MemorySettingsBody, request: Request) -> dict[str, Any]:
    """enabled=false: no memories are injected into the user's conversations, none are learnt."""
    await _memory(request).store.set_enabled(user_id(request), body.enabled)
    return {"enabled": body.enabled}


@router.post("/v1/user/memory/extract", responses=error_responses(401, 400, 404, 503))
async def extract_memory(body: ExtractBody, request: Request) -> dict[str, Any]:
    """Extract the conversation's facts now, from the messages no extraction has read (the idle
    one then skips them); answers with the memories written (new or updated)."""
    gw = gateway(request)
    memory = _memory(request)
    user = user_id(request)
    conversation = await gw.store.get_conversation(body.conversation_id, user)
    if conversation is None:
        raise not_found(f"No conversation {body.conversation_id!r}.", "conversation_id", "conversation_not_found")
    messages = readable(await gw.store.list_messages(conversation.id))
    written = await memory.extract(user, conversation.id, messages, use_model=body.use_model)
    return {"memories": [m.public() for m in written]}
