"""POST /v1/moderations: OpenAI's moderation API, so a client can check text itself with the same
classifiers the chat's input and output checks use (fairway/safety/)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request

from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated
from fairway.gateway.errors import ApiError, documented, invalid, unavailable
from fairway.gateway.schemas import parse_json

router = APIRouter()

MODEL = "fairway-moderation"
# OpenAI's names are accepted so its clients work unchanged; they all get Fairway's classifiers.
MODEL_ALIASES = frozenset({MODEL, "omni-moderation-latest", "omni-moderation-2024-09-26", "text-moderation-latest",
                           "text-moderation-stable", "text-moderation-007"})
MAX_INPUTS = 32
MAX_INPUT_CHARS = 32_768

_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_INPUT_CHARS}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _TEXT}}
REQUEST_SCHEMA = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": {"oneOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                    "items": {"oneOf": [_TEXT, _TEXT_PART]}}],
                  "description": "A text, or a list of texts (or of {type: text, text} parts), to classify."},
        "model": {"type": ["string", "null"], "enum": [*sorted(MODEL_ALIASES), None]},
    },
}


@router.post("/v1/moderations", dependencies=[Depends(authenticated)], responses=documented(400, 401, 413, 503),
             openapi_extra={"requestBody": {"required": True,
                                            "content": {"application/json": {"schema": REQUEST_SCHEMA}}}})
async def moderations(request: Request) -> dict[str, Any]:
    """Classify each input: flagged, and per category (OpenAI's thirteen) a boolean and a score."""
    data = parse_json(await request.body())
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.")
    texts = _inputs(data)
    _check_model(data.get("model"))
    moderator = gateway(request).moderator
    if moderator is None:
        raise unavailable("Moderation is not configured on this server.", "moderation_unavailable")
    results = await moderator.moderate(texts, "api")
    return {"id": f"modr-{uuid.uuid4().hex}", "model": MODEL, "results": [r.to_openai() for r in results]}


def _check_model(model: Any) -> None:
    """None (omitted, or null: what a client passing model=None sends) is the default."""
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {type(model).__name__}.", "model", "invalid_type")
    if model not in MODEL_ALIASES:
        raise invalid(f"Unknown moderation model {model!r}: use {MODEL} (or omit it).", "model", "model_not_found")


def _inputs(data: dict[str, Any]) -> list[str]:
    if "input" not in data:
        raise invalid("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    raw = data["input"]
    if isinstance(raw, str):
        return [_text(raw, "input")]
    if not isinstance(raw, list):
        raise invalid("'input' must be a string or a list of strings.", "input", "invalid_type")
    if not raw:
        raise invalid("'input' must not be an empty list.", "input", "empty_array")
    if len(raw) > MAX_INPUTS:
        raise invalid(f"At most {MAX_INPUTS} inputs at a time, got {len(raw)}.", "input", "too_many_inputs")
    return [_part(item, f"input[{i}]") for i, item in enumerate(raw)]


def _part(item: Any, param: str) -> str:
    if isinstance(item, str):
        return _text(item, param)
    if isinstance(item, dict):
        if item.get("type") != "text":
            raise invalid(f"'{param}.type' {item.get('type')!r} is not supported: only text inputs.", f"{param}.type",
                          "unsupported_content_type")
        if not isinstance(item.get("text"), str):
            raise invalid(f"'{param}.text' must be a string.", f"{param}.text", "invalid_type")
        return _text(item["text"], f"{param}.text")
    raise invalid(f"'{param}' must be a string or a text part.", param, "invalid_type")


def _text(text: str, param: str) -> str:
    if not text.strip():
        raise invalid(f"'{param}' is empty: send text to classify.", param, "empty_input")
    if len(text) > MAX_INPUT_CHARS:
        raise ApiError(400, f"'{param}' is {len(text)} characters long; at most {MAX_INPUT_CHARS}.", param=param,
                       code="input_too_long")
    return text
