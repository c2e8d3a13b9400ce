"""presence_penalty, frequency_penalty and logit_bias through the chat API, as an OpenAI SDK user
sends them: `fairway serve`'s app (bundled model on the CPU) over real HTTP, the one test_api.py
uses (conftest's chat_api_server); bad values are 400s naming the param."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving import MODEL, chat_body, headers

QUESTION = [{"role": "user", "content": "Name a fruit."}]


def reply(chat_api_sdk, messages=QUESTION, max_tokens: int = 8, **kw) -> str:
    return chat_api_sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **kw).choices[0].message.content


def test_banning_the_first_token_of_the_greedy_reply_changes_it(chat_api_sdk, chat_api_tokenizer):
    unbiased = reply(chat_api_sdk)
    banned = chat_api_tokenizer.encode(unbiased)[0]
    assert unbiased.startswith(chat_api_tokenizer.decode([banned]))  # the token the reply began with
    biased = reply(chat_api_sdk, logit_bias={str(banned): -100})
    assert biased != unbiased
    assert banned not in chat_api_tokenizer.encode(biased)
    assert reply(chat_api_sdk) == unbiased  # the next request without a bias is as before


def test_a_bias_of_100_forces_its_token(chat_api_sdk, chat_api_tokenizer):
    (forced,) = chat_api_tokenizer.encode(" banana")
    assert reply(chat_api_sdk, max_tokens=4, logit_bias={str(forced): 100}) == " banana" * 4


def test_a_frequency_penalty_makes_a_repetitive_reply_repeat_less(chat_api_sdk):
    messages = [{"role": "user", "content": "Repeat after me: the cat the cat the cat the cat the cat"}]
    plain = reply(chat_api_sdk, messages, max_tokens=24)
    penalised = reply(chat_api_sdk, messages, max_tokens=24, frequency_penalty=2.0, presence_penalty=1.0)
    assert plain.lower().count("the cat") > 2 * penalised.lower().count("the cat")


def test_the_sdk_gets_a_400_naming_the_param(chat_api_sdk):
    with pytest.raises(openai.BadRequestError) as err:
        reply(chat_api_sdk, logit_bias={"fruit": 5})
    assert err.value.param == "logit_bias" and err.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as err:
        reply(chat_api_sdk, presence_penalty=2.5)
    assert err.value.param == "presence_penalty"


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "invalid_value"),  # past the bundled model's vocabulary
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"5": True}}, "logit_bias", "invalid_type"),
    ({"logit_bias": [5]}, "logit_bias", "invalid_type"),
    ({"presence_penalty": -2.01}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": "high"}, "frequency_penalty", "invalid_value"),
])
def test_bad_penalties_and_biases_are_400s(chat_api_server, extra, param, code):
    response = httpx.post(f"{chat_api_server.url}/v1/chat/completions", json=chat_body("hi", stream=False, **extra),
                          headers=headers(), timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                          "param": param, "code": code}
