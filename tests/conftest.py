"""Shared fixtures: the real bundled model (loaded once per session) and a tiny random one."""

from __future__ import annotations

import os

import pytest
import torch
from backends import MISSING, PROVIDED_BY, missing
from hypothesis import settings

from fairway.models.bundled import bundled_model_path
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model

# Property tests explore new random examples on every developer run; CI (CI=true) runs a fixed set,
# so a fresh clone's run cannot fail on an example no earlier run met: a case a random run finds
# is pinned with @example and fixed where it is found.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def model_path():
    return bundled_model_path()


@pytest.fixture(scope="session")
def real_tokenizer(model_path):
    from fairway.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="session")
def real_model_fp32(model_path):
    from fairway.models.loader import load_model

    return load_model(model_path, torch.float32, weights="dequantized")  # the weights transformers runs


@pytest.fixture(scope="session")
def hf_gguf_reads():
    """A context in which transformers' GGUF reading remembers what it read, for the session:
    its loader parses the file's metadata twice and builds gguf's tensor-name table afresh for each
    of ~400 modules, and each load (the reference model, then the reference tokenizer) parses the
    file again; all pure. Only inside it: Fairway's own loading, under test, reads the file as ever."""
    import contextlib
    import functools

    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    reader, names, parse = (functools.cache(gguf.GGUFReader), functools.cache(gguf.get_tensor_name_map),
                            hf_gguf._gguf_parse_value)
    parsed: dict[tuple, tuple] = {}

    def parse_once(value, data_type):  # value: a part of a remembered reader's field (a scalar, a string)
        key = (id(value), tuple(data_type))
        if key not in parsed:
            parsed[key] = (value, parse(value, data_type))  # (value kept: its id stays its own)
        return parsed[key][1]

    @contextlib.contextmanager
    def remembering():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", reader)
            patch.setattr(gguf, "get_tensor_name_map", names)
            patch.setattr(hf_gguf, "_gguf_parse_value", parse_once)
            yield

    return remembering


@pytest.fixture(scope="session")
def hf_model(model_path, hf_gguf_reads):
    """transformers' own Llama on the same GGUF: the reference for greedy tokens."""
    from transformers import AutoModelForCausalLM

    with hf_gguf_reads():
        return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                    dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_api_server(tmp_path_factory):
    """`fairway serve`'s app (bundled model on the CPU, in-process token log, SQLite) over real HTTP
    for the chat API's modules, test_api.py and test_penalties_api.py: one model load for both.
    No output check: replies here run their course (the idle cancel's is ~700 sampled tokens,
    which at temperature 1.0 may write something the default policy flags, ending it flagged
    instead of stopped). The output check is tested end to end in test_safety_api.py and
    test_web_page.py."""
    from serving import CHAT_API_IDLE_CANCEL_S, CHAT_API_WINDOW, TEST_KEYS, embedded_server

    from fairway.assembly import ServerOptions
    from fairway.safety import SafetySettings

    db = tmp_path_factory.mktemp("api") / "fairway.db"
    options = ServerOptions(database=f"sqlite:///{db}", max_model_len=CHAT_API_WINDOW,
                            idle_cancel_s=CHAT_API_IDLE_CANCEL_S, api_keys=list(TEST_KEYS),
                            safety=SafetySettings(check_output=False))
    with embedded_server(options) as server:
        yield server


@pytest.fixture
def chat_api_sdk(chat_api_server):
    """The OpenAI SDK on chat_api_server, as its modules' users call it (no retries)."""
    import openai
    from serving import API_KEY

    return openai.OpenAI(base_url=f"{chat_api_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def chat_api_tokenizer(chat_api_server):
    """The tokenizer chat_api_server builds its prompts with."""
    from serving import MODEL

    return chat_api_server.gateway.service.tokenizers[MODEL]


@pytest.fixture(scope="session")
def safety_api_server(tmp_path_factory):
    """`fairway serve`'s app with the output check on and an operator's policy edit (serving's
    FLAGGED_WORD added to the violence terms), for test_safety_api.py and test_logprobs.py: one model
    load for both. The stored blocks alone (the greedy reply FLAGGED_WORD is in): the default
    --weights auto prefills on a bf16 copy where the CPU keeps one, and the reply is another there.
    server.engine: its KV blocks (a flagged reply's are freed at once)."""
    from serving import FLAGGED_WORD, TEST_KEYS, embedded_server

    from fairway.assembly import ServerOptions, build_engine
    from fairway.safety import DEFAULT_POLICY, SafetySettings
    from fairway.safety.profanity import available

    tmp = tmp_path_factory.mktemp("safety")
    policy = tmp / "policy.toml"
    policy.write_text(DEFAULT_POLICY.read_text().replace('terms = ["with him in it"',
                                                          f'terms = ["{FLAGGED_WORD}", "with him in it"'))
    options = ServerOptions(database=f"sqlite:///{tmp / 'fairway.db'}", max_model_len=1024, api_keys=list(TEST_KEYS),
                            weights="native",
                            safety=SafetySettings(policy_path=str(policy), profanity_model=available()))
    engine = build_engine(options)
    with embedded_server(options, engine) as server:
        server.engine = engine
        yield server


@pytest.fixture
def tiny_model():
    return random_model(LlamaConfig.tiny())


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A local three-master Redis Cluster for the session (tests/redis_cluster.py)."""
    import subprocess

    from redis_cluster import start_cluster

    try:
        cluster = start_cluster()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        missing("Redis Cluster", f"no local Redis Cluster could start: {exc}")
    yield cluster.url
    cluster.stop()


@pytest.hookimpl(trylast=True)  # after pytest's own summary: the last thing a run prints
def pytest_terminal_summary(terminalreporter) -> None:
    """Say loudly, last, which tests did not run for want of a server or browser, and how to get it."""
    if not MISSING:
        return
    write = terminalreporter.write_line
    terminalreporter.section("NOT TESTED: servers or programs missing", sep="!", red=True, bold=True)
    for what, tests in sorted(MISSING.items()):
        write(f"{what}: {len(set(tests))} tests skipped (e.g. {tests[0]})", red=True, bold=True)
        write(f"    to run them: {PROVIDED_BY[what]}")
    write("(.ci/run starts them all and runs the suite with FAIRWAY_REQUIRE_BACKENDS=1: missing ones fail there.)")
