"""Every route of the API, fuzzed from its own OpenAPI schema (schemathesis) over real HTTP against
`fairway serve`'s app, with a valid key: no response is a server error, every error is in
OpenAI's shape, and every response (its status, its content type, its body) is one the schema
documents. A new route is fuzzed as soon as it is in the schema."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving import MODEL, TEST_KEYS, ThreadServer, headers, wait_ready

from fairway.gateway.body_size import MAX_BODY_BYTES


def subnormals_back() -> None:
    """Fairway's native kernels are built with -ffast-math, whose startup code turns on flush-to-zero
    in the thread that loads them (here, pytest's: another test module may have loaded them), and
    Hypothesis then refuses to generate floats. Schemathesis generates some cases at collection."""
    torch.set_flush_denormal(False)


subnormals_back()

# Enough to meet each route's errors, few enough for well under a minute of CPU: each case is one
# real request (a generated chat body with the served model runs a real, short generation). A
# longer hunt: FAIRWAY_FUZZ_EXAMPLES=250 (random examples each run unless CI=true derandomizes).
MAX_EXAMPLES = int(os.environ.get("FAIRWAY_FUZZ_EXAMPLES", "40"))
WINDOW = 256
TOKENS_PER_MINUTE = 120
PROBE_ANSWER = "/ready"  # its 503 is the readiness probe's own body (what each backend said), not an API error


@schemathesis.check
def openai_error_shape(ctx, response, case) -> bool | None:
    """A 4xx or 5xx body is {"error": {"message", "type", "param", "code"}} with a message."""
    if response.status_code < 400 or case.operation.path == PROBE_ANSWER:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, ignored_auth, openai_error_shape, negative_data_rejection]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fairway.assembly import ServerOptions, embedded_app
    from fairway.limits import LimitsConfig, TierLimits
    from fairway.limits.config import default_tiers

    db = tmp_path_factory.mktemp("fuzz") / "fairway.db"
    # A short window and default reply, and a token quota of a few short replies a minute: the
    # generated bodies that are valid run a few short generations, then meet the 429.
    tiers = {**default_tiers(), "paid": TierLimits(TOKENS_PER_MINUTE, 10_000)}
    options = ServerOptions(database=f"sqlite:///{db}", max_model_len=WINDOW, default_max_tokens=4,
                           limits=LimitsConfig(tiers=tiers), api_keys=list(TEST_KEYS))
    server = ThreadServer(embedded_app(options)).start()
    wait_ready(server.url)
    yield server
    server.stop()


def app_schema() -> dict:
    from fairway.gateway import create_app

    return create_app(None).openapi()  # type: ignore[arg-type]  # (the schema needs no backends)


# Loaded at collection, so each route is a test of its own (test_fuzz[POST /v1/chat/completions]);
# test_the_server_serves_this_schema checks it is the one a server publishes.
schema = schemathesis.openapi.from_dict(app_schema())


def test_the_server_serves_this_schema(server):
    import httpx

    assert httpx.get(f"{server.url}/openapi.json", timeout=30).json() == app_schema()


@pytest.fixture(scope="module")
def real_ids(server) -> dict[str, str]:
    """Path parameters that exist: a finished reply of the key's user, its conversation, a file of the page."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    completion = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers(), timeout=60).json()
    return {"reply_id": completion["id"], "conversation_id": completion["conversation_id"], "name": "app.js"}


def reach_real_ids(case, real: dict[str, str]) -> None:
    """Random ids are never found: about half the valid cases name a real reply, conversation or
    file instead, so the fuzz also reaches what lies past the 404 (event ids, streams).
    (Not for DELETE, which would leave nothing real for the rest.)"""
    if case.method == "DELETE" or not case.path_parameters or not case.meta.generation.mode.is_positive:
        return
    for name, value in real.items():
        if name in case.path_parameters and len(str(case.path_parameters[name])) % 2 == 0:
            case.path_parameters[name] = value


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_every_route_answers_as_its_schema_says(case, server, real_ids):
    subnormals_back()  # (a test that ran meanwhile may have loaded the kernels)
    reach_real_ids(case, real_ids)
    checks = CHECKS
    if (getattr(case, "media_type", None) or "").startswith("multipart/"):
        # A multipart body cannot carry a null or an array: what the generator means as one (an
        # invalid file or purpose) arrives as a valid part ("null"), so it is rightly accepted.
        checks = [check for check in CHECKS if check is not negative_data_rejection]
    elif isinstance(case.body, dict | list) and len(json.dumps(case.body).encode()) > MAX_BODY_BYTES:
        # Past the body limit the edge answers 413 before reading it (documented), whatever else
        # is wrong with it: a rejection schemathesis's list of statuses does not name.
        checks = [check for check in CHECKS if check is not negative_data_rejection]
    case.call_and_validate(base_url=server.url, headers=headers(), checks=checks, timeout=60)
