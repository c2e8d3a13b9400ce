"""The chat completions request: parsing and validation, each mistake a 400 naming its field.

Validation is strict about types (a string is not a number) and lenient about fields we do not
know (OpenAI clients send many optional ones), except those whose meaning we cannot honour.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from fairway.domain import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY, MAX_TOP_LOGPROBS
from fairway.gateway.errors import ApiError, invalid
from fairway.limits import MAX_KEY_LENGTH
from fairway.models.bundled import BUNDLED_MODEL_NAME
from fairway.tools import ToolError, ToolSet, parse_tools
from fairway.tools.results import check_results
from fairway.tools.spec import check_arguments, schema_error

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
UNSUPPORTED_ROLES = {"function"}  # the legacy function-calling role: use tools
# The largest event id a client may name: what a token log can hold (Redis stream ids are 64-bit).
MAX_EVENT_ID = 2**63 - 1
_EVENT_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits: str.isdigit() also takes '²', which int() refuses
# OpenAI's logit_bias: at most 300 token ids (ASCII digits), each to a number in [-100, 100].
# Checked by logit_bias() (OpenAI's codes: invalid_type, invalid_value); the schema documents it.
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
LOGIT_BIAS_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
               "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}},
              {"type": "null"}],
    "default": None,
    "description": "Token id (as a string of digits, in the model's vocabulary) to a bias added to its logit "
                   "before sampling: -100 bans the token in practice, 100 forces it. At most 300 tokens.",
}

# Accepted only at their "off" value: anything else would be silently ignored, which is worse.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # the legacy form of tools
    "function_call": (None, "none", "auto"),
    "audio": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"examples": [
        {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
         "stream": True}]})

    model: str = Field(min_length=1)
    messages: list[ChatMessageIn]
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what the sampler can take
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    # Function calling: client functions ({"type": "function", ...}) and the built-in code tool
    # ({"type": "code_interpreter"}: Python run in the sandbox inside the reply).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: at most one client call per reply (default: several)
    # OpenAI's penalties on the tokens the reply has generated so far, and its per-token bias.
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
        "Subtracted once from the logit of every token the reply has already generated."))
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, description=(
        "Subtracted from the logit of every token the reply has already generated, times its count."))
    logit_bias: Annotated[Any, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    # OpenAI's logprobs: each generated token's log-probability (the model's own, before penalties,
    # bias and temperature, as vLLM gives them), and with top_logprobs its position's likeliest tokens.
    logprobs: bool | None = Field(default=None, description=(
        "Return the log-probability of each generated token in `choices[0].logprobs.content` (streamed: "
        "each chunk's, for the tokens of its delta). The model's own distribution, before penalties, "
        "logit_bias and temperature."))
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "How many of the most likely tokens at each position to return with each token's logprob "
        "(`top_logprobs`, best first). Only with `logprobs: true`."))
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}:
    # held to it by guided decoding in the engine.
    response_format: dict[str, Any] | None = None
    # The seed's fields (design doc 002, section 2.1).
    conversation_id: str | None = Field(default=None, min_length=1, max_length=64)
    # The idempotency key, as X-Idempotency-Key carries it: the limits' bound decides both.
    message_id: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LENGTH)
    last_received_token_index: int | None = Field(default=None, ge=0, le=MAX_EVENT_ID)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None:
            if len(stops) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in stops):
                raise ValueError("stop sequences must be non-empty")
        return stops


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that parses its body itself (strictly, with OpenAI's 400s)
    rather than through FastAPI: the model's schema, inlined (no components to register)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}


def parse_json(body: bytes) -> Any:
    if not body:
        raise invalid("The request body is empty; send a JSON object.")
    try:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:  # or what only the standard parser takes: NaN, big ints, surrogates
            data = _parse_leniently(body)
        return _refuse_nul(data, body)
    except RecursionError:  # past orjson's depth limit (1024) the standard parser, and _nul_at, recurse
        raise invalid("The request body is nested too deeply.") from None


def _parse_leniently(body: bytes) -> Any:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from None
    if b"\\u" in body:  # an escape may be half a surrogate pair: JSON, but no text (cannot be stored or hashed)
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid("The request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                          "which is not text.", code="invalid_text") from None
    return data


def _refuse_nul(data: Any, body: bytes) -> Any:
    """data, unless one of its strings holds a NUL (U+0000): JSON, but text PostgreSQL cannot store
    or even compare (it was a 500 there, stored as sent on SQLite). A 400 naming the field."""
    if b"\\u0000" not in body:  # the only way JSON writes a NUL (a raw one is refused by the parser)
        return data
    where = _nul_at(data)
    if where is None:  # "\\u0000" was an escaped backslash's text
        return data
    named = f"'{where}'" if where else "The request body"
    raise invalid(f"{named} holds a NUL character (\\u0000), which is not allowed in text.", where or None,
                  "invalid_text")


def _nul_at(node: Any, where: str = "") -> str | None:
    """The path of the first string (value or key) in node holding a NUL, as _param writes one
    ("messages[0].content"; "" for the top); None when there is none."""
    if isinstance(node, str):
        return where if "\x00" in node else None
    items = (node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and "\x00" in key:  # named by where it is: the key itself is no name to print
            return where
        found = _nul_at(value, inner)
        if found is not None:
            return found
    return None


def event_id(raw: str | None, param: str = "Last-Event-ID") -> int:
    """A client's event id (Last-Event-ID, ?after=): 0 when absent, 400 unless a plain integer."""
    if raw is None or not raw.strip():
        return 0
    raw = raw.strip()
    if not _EVENT_ID.fullmatch(raw) or int(raw) > MAX_EVENT_ID:
        raise invalid(f"{param} must be a non-negative integer event id, got {raw[:40]!r}.", param, "invalid_event_id")
    return int(raw)


def parse_chat(body: bytes) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The body as parsed JSON (for idempotency fingerprints) and as a validated request."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.")
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_supported(request, data)
    return data, request


def max_tokens_of(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens or request.max_tokens


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = _param(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return invalid(f"Invalid value for '{param}': {message}.", param, "invalid_value")


def _param(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in ("str", "list", "function-after", "none")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _check_supported(request: ChatCompletionRequest, data: dict[str, Any]) -> None:
    if request.n not in (None, 1):
        raise invalid("Only n=1 is supported: one reply per request.", "n", "unsupported_value")
    for name, allowed in UNSUPPORTED_FIELDS.items():
        if data.get(name) not in allowed:
            raise invalid(f"'{name}' is not supported by this server yet.", name, "unsupported_parameter")
    if not request.messages:
        raise invalid("'messages' must contain at least one message.", "messages", "empty_array")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is "
                      "set.", "top_logprobs", "invalid_value")


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as {"role", "content": str} (an assistant's with its tool_calls, a tool's with
    its tool_call_id), checked; the last one must be the user's, or a tool result."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        param = f"messages[{i}]"
        if message.role in UNSUPPORTED_ROLES:
            raise invalid(f"Role '{message.role}' is not supported: send tool results as role 'tool'.",
                          f"{param}.role", "unsupported_value")
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(
                f"Invalid role '{message.role}' in {param}: use system, developer, user, assistant or tool.",
                f"{param}.role",
                "invalid_value",
            )
        item: dict[str, Any] = {"role": role, "content": _text(message.content, role, param)}
        if message.tool_calls:
            if role != "assistant":
                raise invalid(f"Only an assistant message has tool_calls ({param} is {role}'s).",
                              f"{param}.tool_calls", "invalid_value")
            item["tool_calls"] = [_tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
        if role == "tool":
            if not message.tool_call_id:
                raise invalid(f"'{param}.tool_call_id' is required: the id of the call this result answers.",
                              f"{param}.tool_call_id", "missing_required_parameter")
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    try:  # a conversation's stored calls are the service's to check (fairway/tools/results.py)
        check_results(out, None if request.conversation_id else ())
    except ToolError as exc:
        raise invalid(str(exc), exc.param, "invalid_value") from None
    if out[-1]["role"] not in ("user", "tool"):
        raise invalid("The last message must be the user's (or a tool result): it is the one the reply answers.",
                      "messages")
    if not any(m["role"] == "user" for m in out) and not request.conversation_id:
        raise invalid("The messages need a user message to answer.", "messages")
    return out


def _tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's tool call as OpenAI sends it back: id, type function, name, arguments."""
    function = call.get("function")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise invalid(f"'{where}.id' must be the call's id (a non-empty string).", f"{where}.id",
                      "missing_required_parameter")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise invalid(f"'{where}' must be {{\"type\": \"function\", \"function\": {{name, arguments}}}}.",
                      where, "invalid_value")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid(f"'{where}.function.name' must be a non-empty string.", f"{where}.function.name",
                      "missing_required_parameter")
    try:
        arguments = check_arguments(function.get("arguments", "{}"), f"{where}.function.arguments")
    except ToolError as exc:
        raise invalid(str(exc), exc.param, "invalid_tool_arguments") from None
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def tool_set(request: ChatCompletionRequest) -> ToolSet | None:
    """The request's tools, checked (400 naming the field); None for a reply without tools."""
    try:
        return parse_tools(request.tools, request.tool_choice, parallel_tool_calls=request.parallel_tool_calls)
    except ToolError as exc:
        raise invalid(str(exc), exc.param, "invalid_tools") from None


def _text(content: str | list[dict[str, Any]] | None, role: str, param: str) -> str:
    if content is None:
        if role in ("assistant", "tool"):
            return ""
        raise invalid(f"'{param}.content' is required for a {role} message.", f"{param}.content", "missing_required_parameter")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type")
        if kind in FILE_PARTS:
            if role != "user":  # only the user attaches files: ignored elsewhere, it would vanish unsaid
                raise invalid(f"Content part type {kind!r} is not supported in a {role} message: attach files in "
                              "a user message.", f"{where}.type", "unsupported_content_type")
            file_part_id(part, where)  # checked here; file_ids() collects them
            continue
        if kind != "text":
            raise invalid(
                f"Content part type {kind!r} is not supported: use text, or file_url / file with a file_id.",
                f"{where}.type",
                "unsupported_content_type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{where}.text' must be a string.", f"{where}.text", "invalid_type")
        texts.append(text)
    return "\n".join(texts)


FILE_PARTS = ("file_url", "file", "input_file")  # the seed's, OpenAI's chat and responses APIs'


def file_part_id(part: dict[str, Any], where: str) -> str:
    """A file part's file_id: {"type": "file_url", "file_id"} (the seed's), {"type": "file",
    "file": {"file_id"}} (OpenAI's) or {"type": "input_file", "file_id"}."""
    inner = part.get("file") if isinstance(part.get("file"), dict) else part
    file_id = inner.get("file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid(f"'{where}' needs a file_id (upload the file with POST /v1/files first).",
                      f"{where}.file_id", "missing_required_parameter")
    return file_id


def file_ids(request: ChatCompletionRequest) -> dict[int, list[str]]:
    """The file ids each of the request's user messages attaches, by its index in messages: in
    order, once each (a message without files is left out)."""
    found: dict[int, list[str]] = {}
    for i, message in enumerate(request.messages):
        if message.role != "user" or not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.get("type") in FILE_PARTS:
                file_id = file_part_id(part, f"messages[{i}].content[{j}]")
                if file_id not in found.setdefault(i, []):
                    found[i].append(file_id)
    return found


def sampling(request: ChatCompletionRequest, vocab_size: int | None = None) -> dict[str, Any]:
    """The engine's SamplingParams fields the request sets (defaults are the engine's). vocab_size:
    the model's, which every logit_bias token id must be below (None: not checked here)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):  # 0 is the engine's default
            out[name] = getattr(request, name)
    bias = logit_bias(request.logit_bias, vocab_size)
    if bias:
        out["logit_bias"] = bias
    if request.temperature is not None:
        out["temperature"] = request.temperature
    if request.top_p is not None:
        out["top_p"] = request.top_p
    max_tokens = max_tokens_of(request)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if request.stop:
        out["stop"] = request.stop
    if request.seed is not None:
        out["seed"] = request.seed
    if request.ignore_eos:
        out["ignore_eos"] = True
    if request.logprobs:
        out["logprobs"] = request.top_logprobs or 0  # the engine's: how many top tokens (0: the token's own)
    guided = guided_decoding(request.response_format)
    if guided is not None:
        out["guided_decoding"] = guided
    return out


def logit_bias(bias: Any, vocab_size: int | None) -> dict[str, float] | None:
    """OpenAI's logit_bias, checked, as JSON carries it to the replica ({"token id": bias}); each
    mistake a 400 naming the param."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise invalid(f"'logit_bias' must be an object mapping token ids to numbers, got {type(bias).__name__}.",
                      "logit_bias", "invalid_type")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}.",
                      "logit_bias", "invalid_value")
    out: dict[str, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise invalid(f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id (a non-negative integer).",
                          "logit_bias", "invalid_value")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise invalid(f"Invalid key in 'logit_bias': token id {token} is outside the model's vocabulary "
                          f"(0..{vocab_size - 1}).", "logit_bias", "invalid_value")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise invalid(f"Invalid value in 'logit_bias' for token {token}: a number is expected, got "
                          f"{type(value).__name__}.", "logit_bias", "invalid_type")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise invalid(f"Invalid value in 'logit_bias' for token {token}: {value!r} is outside [-100, 100].",
                          "logit_bias", "invalid_value")
        out[str(token)] = float(value)
    return out


def guided_decoding(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as the engine's guided decoding (None: free text); 400 if malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("'response_format.json_schema.schema' must be a JSON Schema object.",
                          "response_format.json_schema.schema", "invalid_value")
        try:
            json.dumps(schema)
        except (TypeError, ValueError):
            raise invalid("'response_format.json_schema.schema' must be plain JSON.",
                          "response_format.json_schema.schema", "invalid_value") from None
        error = schema_error(schema)
        if error:
            raise invalid(f"'response_format.json_schema.schema' cannot be used: {error}.",
                          "response_format.json_schema.schema", "invalid_value")
        return {"json_schema": schema}
    raise invalid(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}.",
                  "response_format.type", "invalid_value")

