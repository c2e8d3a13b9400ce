"""Liveness, readiness and the served models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated
from fairway.gateway.errors import ApiError, error_responses

router = APIRouter()


class Readiness(BaseModel):
    """A probe's answer, not an API error: what each backend said."""

    status: str
    checks: dict[str, Any]


@router.get("/health")
async def health() -> dict[str, str]:
    """The process answers: nothing else is checked (that is /ready)."""
    return {"status": "ok"}


@router.get("/ready", responses={200: {"model": Readiness},
                                  503: {"model": Readiness, "description": "A backend or every replica is down."}})
async def ready(request: Request) -> JSONResponse:
    """Ready when the token log and the store answer and some replica serves a model of ours."""
    gw = gateway(request)
    checks: dict[str, Any] = {}
    try:
        await gw.token_log.exists("ready-probe")
        checks["token_log"] = "ok"
    except Exception as exc:
        checks["token_log"] = f"unavailable: {exc}"
    try:
        await gw.store.list_conversations("ready-probe", limit=1)
        checks["store"] = "ok"
    except Exception as exc:
        checks["store"] = f"unavailable: {exc}"
    try:
        models = await gw.service.served_models()
        checks["models"] = models or "no live replica"
    except Exception as exc:
        models = []
        checks["models"] = f"unavailable: {exc}"
    ok = checks["token_log"] == "ok" and checks["store"] == "ok" and bool(models)
    return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)


@router.get("/v1/models", dependencies=[Depends(authenticated)], responses=error_responses(401, 503))
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": await _served(request)}


# {model:path}: a model named like a Hugging Face folder ("org/name") is one id with a slash in it.
@router.get("/v1/models/{model:path}", dependencies=[Depends(authenticated)], responses=error_responses(401, 404, 503))
async def model(request: Request, model: str) -> dict[str, Any]:
    """One served model (the SDK's models.retrieve), as the list shows it; 404 if none serves it."""
    for entry in await _served(request):
        if entry["id"] == model:
            return entry
    raise ApiError(404, f"The model {model!r} does not exist or no replica serves it: GET /v1/models lists "
                        "the ones served.", param="model", code="model_not_found")


async def _served(request: Request) -> list[dict[str, Any]]:
    """The models some live replica serves, each as OpenAI's model object with what it runs on."""
    gw = gateway(request)
    live = await gw.router.live()
    data = []
    for name in await gw.service.served_models():
        replicas = [r for r in live if r.model == name]
        coding = [r for r in replicas if not r.sandbox_off]
        data.append({"id": name, "object": "model", "created": int(min(r.started_at for r in replicas)),
                     "owned_by": "fairway", "context_window": min(r.max_model_len for r in replicas),
                     "replicas": len(replicas),
                     # The built-in tool ({"type": "code_interpreter"}): whether a replica runs it, else why not.
                     "code_interpreter": {"available": bool(coding),
                                          "reason": None if coding else replicas[0].sandbox_off}})
    return data
