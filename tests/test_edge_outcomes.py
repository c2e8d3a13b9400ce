"""What the edge counts and bills, as a user and an operator see it over HTTP: a refusal counted
under what it was (fairway:rate_limited, fairway:chat_requests), a request the service refused for
its own load left off the user's request rate. The embedded server on a scripted model
(tests/scripted_engine.py): the gateway, limits, relay, replica worker and store are the real ones."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.scripted_engine import ScriptedEngine
from tests.serving import API_KEY, MODEL, TEST_KEYS, chat_body, embedded_server, headers, sse_events, wait_for

TPM_KEY = "sk-test-small-quota"  # free tier: a quota of a few requests
FOLLOW_KEY = "sk-test-follower-free"  # free tier, a user of its own
LEAVE_KEY = "sk-test-follower-paid"  # paid tier, a user of its own
RPM_KEY = "sk-test-few-requests"  # background tier: RPM requests a minute
TPM, RPM = 400, 3


THREAT = "I will kill you."  # the bundled policy flags it: the output check stops the reply
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def script(prompt: str) -> str:
    """The scripted model, by the user's last message: a long reply when asked for one (to hold a
    stream open), a call to get_weather when it is offered, a threat, else a short reply."""
    turn = prompt[prompt.rindex("<|im_start|>user"):]
    if "long" in turn:
        return "This is a word. " * 150  # sentence by sentence: the output check releases each at once
    if "weather" in turn and "get_weather" in prompt:
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    if "threat" in turn:
        return f"Here it is. {THREAT} There."
    return "Hi there."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fairway.assembly import ServerOptions, load_tokenizer
    from fairway.limits import LimitsConfig, TierLimits
    from fairway.limits.config import default_tiers

    db = tmp_path_factory.mktemp("outcomes") / "fairway.db"
    tiers = {**default_tiers(), "free": TierLimits(TPM, 1000), "background": TierLimits(100_000, RPM)}
    options = ServerOptions(database=f"sqlite:///{db}", memory=False, limits=LimitsConfig(tiers=tiers),
                            api_keys=[*TEST_KEYS, (TPM_KEY, "tpm-user", "free"), (RPM_KEY, "rpm-user", "background"),
                                                (FOLLOW_KEY, "follow-user", "free"), (LEAVE_KEY, "leave-user", "paid")])
    engine = ScriptedEngine(load_tokenizer(None), script, step_s=0.01)
    with embedded_server(options, engine) as server:
        yield server


def samples(server, family: str, *labels: str) -> dict[tuple[str, ...], float]:
    """A counter family's totals on the server's /metrics, by the values of these labels."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = next((f for f in text_string_to_metric_families(text) if f.name == family), None)
    return {tuple(s.labels[label] for label in labels): s.value
            for s in (found.samples if found else []) if s.name.endswith("_total")}


def rate_limited(server) -> dict[tuple[str, ...], float]:
    return samples(server, "fairway:rate_limited", "type")


def chat_requests(server) -> dict[tuple[str, ...], float]:
    return samples(server, "fairway:chat_requests", "status", "outcome")


def moved(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def post(server, body: dict, key: str = API_KEY) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers(key), timeout=60)


def test_a_request_too_large_for_the_quota_is_not_counted_as_rate_limited(server):
    """A request alone over the per-minute token quota is a 400 request_too_large (no wait helps):
    it was never rate limited, so fairway:rate_limited{type="tokens"} does not move; it counts as
    its own outcome in fairway:chat_requests. A request over what is left of the quota is rate
    limited, and counted so."""
    limited, requests = rate_limited(server), chat_requests(server)
    too_large = post(server, chat_body("Hello.", max_tokens=TPM - 5, stream=False), TPM_KEY)
    assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "request_too_large"
    assert moved(limited, rate_limited(server)) == {}
    assert moved(requests, chat_requests(server)) == {("400", "request_too_large"): 1}

    codes = [post(server, chat_body(f"A long answer {i}.", max_tokens=TPM // 3, stream=False), TPM_KEY).status_code
             for i in range(4)]
    assert codes.count(429) >= 1 and 400 not in codes, codes
    assert moved(limited, rate_limited(server)) == {("tokens",): codes.count(429)}


def test_a_request_the_server_refused_for_its_load_does_not_use_the_users_request_rate(server):
    """A 503 overloaded (the gateway's admission queue full) is the service's load, not the user's
    doing: it leaves the user's requests per minute as they were. Before, five such refusals
    spent a 3-a-minute user's minute, and their next request was a 429."""
    from fairway.limits import Admission

    limits = server.gateway.limits
    saved = limits.admission
    limits.admission = Admission(max_in_flight=1, max_waiting=0, timeout_s=0.3)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=chat_body("A long answer.", max_tokens=300),
                             headers=headers()) as held:
                assert held.status_code == 200
                events = sse_events(held)  # (dropping the iterator would close the connection)
                next(events)  # the one slot is taken while this stream is open
                for _ in range(5):
                    refused = post(server, chat_body("Hi.", stream=False), RPM_KEY)
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
                    assert refused.headers["x-ratelimit-remaining-requests"] == str(RPM)
                http.post(f"/v1/replies/{held.headers['x-reply-id']}/stop", headers=headers())
        wait_for(lambda: limits.admission.in_flight == 0, timeout=30)
        answered = [post(server, chat_body(f"Hi {i}.", stream=False), RPM_KEY) for i in range(RPM + 1)]
        assert [r.status_code for r in answered] == [200] * RPM + [429]
        assert answered[-1].json()["error"]["type"] == "requests"
    finally:
        limits.admission = saved


def test_replies_are_counted_by_their_finish_reason_as_vllm_counts_them(server):
    """fairway:request_success_total{finished_reason} (vLLM's name), once per reply, under the
    reason its response gave: stop, length, tool_calls, content_filter; every reason (abort too)
    is shown from the model's first reply on."""
    def success() -> dict[tuple[str, ...], float]:
        return samples(server, "fairway:request_success", "model", "finished_reason")

    before = success()
    bodies = {"stop": chat_body("Say hi.", stream=False),
              "length": chat_body("A long answer.", max_tokens=5, stream=False),
              "tool_calls": chat_body("What is the weather in Paris?", max_tokens=60, stream=False, tools=[WEATHER]),
              "content_filter": chat_body("Tell me a threat.", max_tokens=40, stream=False)}
    for reason, body in bodies.items():
        response = post(server, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == reason
    expected = {(MODEL, reason): 1 for reason in bodies}
    wait_for(lambda: moved(before, success()) == expected, timeout=30)
    assert {reason for model, reason in success() if model == MODEL} == {
        "stop", "length", "tool_calls", "content_filter", "abort"}


def usage_totals(server, key: str) -> dict:
    return httpx.get(f"{server.url}/v1/usage", headers=headers(key), timeout=30).json()["totals"]


def quota_used(server, user: str, tier: str) -> int:
    return server.call(server.gateway.limits.tokens.state(user, MODEL, tier)).used


def test_a_request_sharing_a_generation_reserves_its_tokens_as_any_request(server):
    """Single flight shares the generation, not the quota: the follower reserves the prompt and
    max_tokens it would as a request of its own, so a user cannot get past their tokens per minute
    by sending the same greedy request many times; both are settled to what was billed."""
    body = chat_body("A long answer, please.", max_tokens=150)
    with httpx.Client(base_url=server.url, headers=headers(FOLLOW_KEY), timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as leader:
            assert leader.status_code == 200
            leader_events = sse_events(leader)
            next(leader_events)
            with http.stream("POST", "/v1/chat/completions", json=body) as follower:
                assert follower.status_code == 200 and follower.headers["x-shared-generation"] == "true"
                reserved = int(follower.headers["x-context-tokens"]) + 150
                assert int(follower.headers["x-ratelimit-remaining-tokens"]) == TPM - 2 * reserved
                # Fits beside one reservation, not beside two.
                other = http.post("/v1/chat/completions", json=chat_body("Hi.", max_tokens=TPM - 2 * reserved + 10,
                                                                         stream=False))
                assert other.status_code == 429 and other.json()["error"]["type"] == "tokens", other.text
                assert [e.finish_reason for e in sse_events(follower) if e.finish_reason] == ["length"]
            assert [e.finish_reason for e in leader_events if e.finish_reason] == ["length"]
    totals = wait_for(lambda: (t := usage_totals(server, FOLLOW_KEY))["requests"] == 2 and t)
    assert totals["completion_tokens"] == 2 * 150
    wait_for(lambda: quota_used(server, "follow-user", "free") == totals["total_tokens"])


def test_a_follower_that_leaves_early_is_billed_for_what_it_was_sent(server):
    """A follower whose client leaves before the reply's end gets a usage record of its own, with
    its prompt and the completion tokens it was sent, and its reservation settled to them; the
    leader, whose reply goes on, is billed the whole reply at its end."""
    body = chat_body("A long answer, please.", max_tokens=300)
    with httpx.Client(base_url=server.url, headers=headers(LEAVE_KEY), timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as leader:
            leader_events = sse_events(leader)
            next(leader_events)
            with http.stream("POST", "/v1/chat/completions", json=body) as follower:
                assert follower.headers["x-shared-generation"] == "true"
                prompt = int(follower.headers["x-context-tokens"])
                events = sse_events(follower)
                got = "".join(next(events).content for _ in range(3))
                assert got  # the client leaves with a few sentences
            assert [e.finish_reason for e in leader_events if e.finish_reason] == ["length"]
    totals = wait_for(lambda: (t := usage_totals(server, LEAVE_KEY))["requests"] == 2 and t)
    assert totals["prompt_tokens"] == 2 * prompt
    sent = totals["completion_tokens"] - 300
    assert 0 < sent < 300, totals
    wait_for(lambda: quota_used(server, "leave-user", "paid") == totals["total_tokens"])


# -- logit_bias and the mini pool ----------------------------------------------------------------

MINI = "fairway-mini"
SAME_UP_TO, MINI_VOCAB = 1000, 4096


class OtherVocabulary:
    """The mini model's tokenizer as a logit_bias sees another model's: the same text (the
    scripted engine needs it), but a vocabulary of MINI_VOCAB ids of which only the first
    SAME_UP_TO spell the bundled model's tokens."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    @property
    def vocab_size(self) -> int:
        return MINI_VOCAB

    def id_to_token(self, token_id: int) -> str | None:
        if token_id >= MINI_VOCAB:
            return None
        token = self._tokenizer.id_to_token(token_id)
        return token if token_id < SAME_UP_TO else f"<other {token_id}>"


@pytest.fixture(scope="module")
def with_mini(tmp_path_factory):
    """A server whose model has a mini pool of another vocabulary; the free tier's quota for the
    main model holds one request, then the mini pool serves (mini_past_quota)."""
    from fairway.assembly import ServerOptions, load_tokenizer
    from fairway.limits import LimitsConfig

    db = tmp_path_factory.mktemp("mini") / "fairway.db"
    limits = LimitsConfig(model_tokens_per_minute={MODEL: {"free": 100}})
    options = ServerOptions(database=f"sqlite:///{db}", memory=False, limits=limits, mini_model=f"/models/{MINI}.gguf",
                            api_keys=[(TPM_KEY, "bias-user", "free")])
    tokenizer = load_tokenizer(None)
    engine = ScriptedEngine(tokenizer, script)
    mini = ScriptedEngine(OtherVocabulary(tokenizer), script)
    with embedded_server(options, engine, mini) as server:
        yield server


def test_a_logit_bias_is_checked_for_the_model_that_serves_the_reply(with_mini):
    """logit_bias names the requested model's token ids. Past that vocabulary it is a 400 naming
    the param. Past the user's quota a request moves to the mini pool only where those ids spell
    the same tokens there: one biasing ids the mini model lacks or spells otherwise stays with
    its model, and gets the quota's 429, as when no mini pool runs; before, it was moved and
    biased other tokens, or ids past the mini model's vocabulary."""
    vocab = with_mini.gateway.service.vocab_size(MODEL)
    past = post(with_mini, chat_body("Hi.", stream=False, logit_bias={str(vocab): 5}), TPM_KEY)
    assert past.status_code == 400 and past.json()["error"]["param"] == "logit_bias", past.text

    spent = post(with_mini, chat_body("Hi.", max_tokens=60, stream=False), TPM_KEY)  # the main model's quota
    assert spent.status_code == 200 and spent.headers["x-fairway-model"] == MODEL
    for token in (MINI_VOCAB + 10, SAME_UP_TO + 10):  # the mini model lacks it; spells it otherwise
        kept = post(with_mini, chat_body("Hi.", max_tokens=60, stream=False, logit_bias={str(token): 5}), TPM_KEY)
        assert kept.status_code == 429 and kept.json()["error"]["type"] == "tokens", (token, kept.text)
    for bias in ({str(SAME_UP_TO - 10): 5}, None):  # the same token there, or no bias: the mini pool serves
        extra = {"logit_bias": bias} if bias else {}
        moved_on = post(with_mini, chat_body("Hi.", max_tokens=60, stream=False, **extra), TPM_KEY)
        assert moved_on.status_code == 200, moved_on.text
        assert (moved_on.headers["x-fairway-model"], moved_on.headers["x-fairway-fallback"]) == (MINI, "quota")


def test_past_both_the_models_and_its_mini_pools_quota_is_a_429(with_mini):
    """A request whose user has spent the main model's quota and the mini pool's too was a 500
    (the mini pool's refusal escaped the gateway): it is the mini pool's 429, with Retry-After."""
    quotas = with_mini.gateway.limits.config.model_tokens_per_minute
    quotas[MINI] = {"free": 100}
    try:
        codes = []
        for i in range(4):
            response = post(with_mini, chat_body(f"A long answer {i}.", max_tokens=60, stream=False), TPM_KEY)
            codes.append(response.status_code)
            if response.status_code == 429:
                error = response.json()["error"]
                assert error["type"] == "tokens" and MINI in error["message"], error
                assert int(response.headers["retry-after"]) >= 1
        assert 500 not in codes and codes[-1] == 429, codes
    finally:
        del quotas[MINI]
