"""Peak load, end to end over real HTTP: a flood of free requests and a trickle of paid ones
against one replica with two seats. Paid TTFT stays within 2x of an idle replica's (the
middle one; none waits as one queued behind the flood would); free
requests meet the configured treatment once the predicted wait passes the limit (shed: 503 +
Retry-After and the reply stored SHED; mini: the mini pool serves, and says so; shorten: fewer
max tokens, and says how many); nothing hangs. And a user whose token quota for the main model
is spent is served by its mini pool, billed at the mini model's price.

Deployed as at scale, on a Redis of the test's own: the main replica and the mini pool are
`fairway replica` processes (`--mini-of` for the mini pool), so neither engine steps in the
gateway's process or under its GIL; the gateway runs here, where the test reads its store. Both
models are small random Llamas with the bundled tokenizer, written as Hugging Face folders: the
engine's speed is not what is measured, the lanes are. The 2x is checked only while the machine
was the test's (tests/machine.py): another job's processes holding the CPUs, or a stop of the
test's processes, skip it saying so."""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from backends import missing
from machine import Machine
from processes import PrivateRedis, Processes
from serving import ThreadServer, wait_for

from fairway.assembly import ServerOptions, gateway_app, load_tokenizer
from fairway.cli import _server_options, build_parser
from fairway.domain import ReplyState
from fairway.limits import LimitsConfig, TierLimits
from fairway.models.tokenizer import Tokenizer
from fairway.router.policy import RouterSettings
from fairway.router.pressure import PressureSettings
from fairway.usage.pricing import Price, Pricing

MODEL, MINI = "fairway-peak", "fairway-mini"  # the models' names: their folders'
FREE_KEY, PAID_KEY, BUSINESS_KEY = "sk-peak-free", "sk-peak-paid", "sk-peak-business"
SEATS = 2
MINI_SEATS = 8
FREE_TOKENS = 80  # a free reply holds its seat this many steps
SHORTER = 6
MINI_PRICE = Price(prompt_per_1k=0.001, completion_per_1k=0.002)
MAIN_QUOTA = 300  # business-tier tokens per minute on the main model: the quota test spends it
OTHERS_MAX = 0.5  # others held a CPU of the two for 4 s: a TTFT check that failed then skips instead


def write_random_llama(folder: Path, tokenizer: Tokenizer, seed: int, hidden: int, layers: int) -> Path:
    """A random Llama as a Hugging Face folder (config.json, model.safetensors, the tokenizer's
    files): what `fairway replica --model FOLDER` loads, serving it as the folder's name."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    heads, kv_heads, head_dim, inter, vocab = 4, 2, hidden // 4, 4 * hidden, tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.2

    state = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": weight(inter, hidden), p + "mlp.up_proj.weight": weight(inter, hidden),
                  p + "mlp.down_proj.weight": weight(hidden, inter),
                  p + "input_layernorm.weight": torch.ones(hidden),
                  p + "post_attention_layernorm.weight": torch.ones(hidden)}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 4096, "tie_word_embeddings": True}))
    (folder / "tokenizer.json").write_text(tokenizer.backend_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": tokenizer.id_to_token(tokenizer.eos_token_id), "chat_template": tokenizer.chat_template}))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        missing("Redis", "no redis-server on this machine")
    folder = tmp_path_factory.mktemp("peak")
    tokenizer = load_tokenizer(None)
    # Tiny models: a step is short next to a request's fixed costs (HTTP, store, relay), as a GPU's
    # step is next to a real TTFT; the mini one smaller still.
    main = write_random_llama(folder / MODEL, tokenizer, 1, 64, 2)
    mini = write_random_llama(folder / MINI, tokenizer, 2, 32, 1)
    redis = PrivateRedis(folder, durable=False)
    redis.start()
    procs = Processes(folder)
    replica = ["replica", "--redis", redis.url, "--dtype", "float32", "--max-model-len", "1024",
               "--safety-output", "off", "--log-level", "warning"]
    one_thread = {"OMP_NUM_THREADS": "1"}  # the machine's two CPUs: one each, as the local fleet gives them
    procs.start("main", *replica, "--model", str(main), "--max-inflight", str(SEATS), env=one_thread)
    # The mini pool stands for machines of its own: on these two CPUs it takes what the gateway and
    # the main replica leave (nice), as it would not take theirs deployed.
    procs.start("mini", *replica, "--model", str(mini), "--mini-of", MODEL, "--max-inflight", str(MINI_SEATS),
                env=one_thread, nice=10)
    wide = TierLimits(tokens_per_minute=10_000_000, requests_per_minute=100_000)
    limits = LimitsConfig(tiers={"free": wide, "paid": wide, "business": wide, "background": wide},
                          model_tokens_per_minute={MODEL: {"business": MAIN_QUOTA}},
                          ip_requests_per_minute=100_000)
    options = ServerOptions(
        model=str(main), mini_model=str(mini), redis=redis.url,
        database=f"sqlite:///{folder / 'fairway.db'}", max_model_len=1024, memory=False, limits=limits,
        pricing=Pricing(models={MINI: MINI_PRICE}),
        # The flood (15 free replies a second, each holding one of 2 seats FREE_TOKENS steps of a
        # few ms) outruns the drain: a limit of 0.2 s is passed within the first second. Replies
        # that long make the limit worth several steps' wait, so a paid request that did not go
        # first (seats.py, the scheduler) would wait past the 2x.
        router=RouterSettings(pressure=PressureSettings(max_wait_s=MAX_WAIT_S, shorter_max_tokens=SHORTER)),
        api_keys=[(FREE_KEY, "free-user", "free"), (PAID_KEY, "paid-user", "paid"),
                  (BUSINESS_KEY, "business-user", "business")])
    options.safety.check_input = False  # random models say random words
    running = None
    try:
        app = gateway_app(options)
        running = ThreadServer(app).start()
        running.gateway = app.state.gateway
        wait_for(lambda: {r.model for r in running.call(running.gateway.router.live(refresh=True))} == {MODEL, MINI},
                 timeout=180, every=0.5)
    except BaseException:
        if running is not None:
            running.stop()
        procs.stop()
        redis.stop()
        raise RuntimeError(procs.tails()) from None
    yield running
    running.stop()
    procs.stop()
    redis.stop()


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: dict[str, Any] = field(default_factory=dict)
    ttft: float | None = None
    tokens: int = 0


def chat(content: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}


async def paid_request(client: httpx.AsyncClient, url: str, i: int) -> Answer:
    """A streamed paid request; TTFT: until its first token's event."""
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=chat(f"paid question {i}", 4, True),
                             headers={"Authorization": f"Bearer {PAID_KEY}"}) as response:
        answer = Answer(response.status_code, response.headers)
        async for line in response.aiter_lines():
            if line.startswith("id:") and answer.ttft is None:
                answer.ttft = time.perf_counter() - started
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                answer.tokens += sum(1 for c in chunk.get("choices", []) if c.get("delta", {}).get("content"))
    return answer


async def free_request(client: httpx.AsyncClient, url: str, i: int) -> Answer:
    response = await client.post(f"{url}/v1/chat/completions",
                                 json=chat(f"free question {i}", FREE_TOKENS, False, message_id=f"free-{i}-{time.time()}"),
                                 headers={"Authorization": f"Bearer {FREE_KEY}"})
    return Answer(response.status_code, response.headers, response.json())


async def idle_paid_ttfts(url: str, n: int = 12) -> list[float]:
    async with httpx.AsyncClient(timeout=30) as client:
        await paid_request(client, url, -1)  # warm: the first request of a process pays for imports
        return [(await paid_request(client, url, i)).ttft for i in range(n)]


async def flood(url: str, seconds: float = 3.0, free_per_s: float = 15.0,
                paid_every_s: float = 0.2) -> tuple[list[Answer], list[Answer]]:
    """Free requests arriving at a fixed rate (an open loop: they do not wait for each other),
    paid ones one after another; every request must end within the client's timeout."""
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=500)) as client:
        end = loop.time() + seconds

        async def free_arrivals() -> list[Answer]:
            tasks, i = [], 0
            while loop.time() < end:
                tasks.append(asyncio.create_task(free_request(client, url, i)))
                i += 1
                await asyncio.sleep(1 / free_per_s)
            return await asyncio.gather(*tasks)

        async def paid_trickle() -> list[Answer]:
            answers = []
            await asyncio.sleep(1.0)  # once the free queue has built up
            while loop.time() < end:
                answers.append(await paid_request(client, url, len(answers)))
                await asyncio.sleep(paid_every_s)
            return answers

        return await asyncio.wait_for(asyncio.gather(free_arrivals(), paid_trickle()), 60)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


STEP_SLACK_S = 0.025
MAX_WAIT_S = 0.2  # the pool's wait limit: about what a request queued behind the flood waits


def idle(server) -> None:
    """Until the replica has nothing in flight: each flood starts from an empty queue."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = server.call(server.gateway.router.live(refresh=True))
        if all(r.load == 0 for r in live):
            return
        time.sleep(0.1)
    raise AssertionError("the replicas never went idle")


@pytest.mark.parametrize("treatment", ["shed", "mini", "shorten"])
def test_a_free_flood_is_treated_as_configured_while_paid_ttft_stays_near_idle(server, treatment) -> None:
    server.gateway.router.settings.pressure.free_at_capacity = treatment
    idle(server)
    machine = Machine()
    machine.start()
    try:
        began = time.monotonic()
        baseline = asyncio.run(idle_paid_ttfts(server.url))
        free, paid = asyncio.run(flood(server.url))
        ended = time.monotonic()
    finally:
        machine.done.set()

    # Paid: never refused, every stream complete, the middle paid TTFT within 2x of the idle p99
    # (plus one engine step of slack: idle TTFTs here are ~10-80 ms, where a step's or the event
    # loop's jitter moves one of six samples past 2x), and no more than one past idle by the wait
    # limit: a paid request queued behind the free flood would wait about that long, every one of
    # them, while one alone is the 2-core machine's (CI once saw 395 ms among 15-90 ms others).
    assert paid and all(a.status == 200 and a.tokens == 4 for a in paid)
    flood_p99, idle_p99 = p99([a.ttft for a in paid]), p99(baseline)
    flood_median = statistics.median(a.ttft for a in paid)
    second_worst = sorted(a.ttft for a in paid)[-2] if len(paid) > 1 else paid[0].ttft
    print(f"{treatment}: paid TTFT p99 {flood_p99 * 1000:.0f} ms (median {flood_median * 1000:.0f}) under the "
          f"flood, {idle_p99 * 1000:.0f} ms idle; "
          f"{len(free)} free, {sum(a.status == 503 for a in free)} shed, "
          f"{sum('x-fairway-fallback' in a.headers for a in free)} treated otherwise; paid TTFTs (ms): "
          f"{[round(a.ttft * 1000) for a in paid]}, idle {[round(t * 1000) for t in baseline]}")
    served = [a for a in free if a.status == 200]
    treated = [a for a in served if "x-fairway-fallback" in a.headers]
    assert {a.status for a in free} <= {200, 503}
    assert served, "some free requests were served before the pool filled"
    if treatment == "shed":
        shed = [a for a in free if a.status == 503]
        assert len(shed) >= len(free) // 10 and not treated
        for a in shed:
            assert a.body["error"]["code"] == "shed" and a.body["error"]["type"] == "server_error"
            assert 1 <= int(a.headers["retry-after"]) <= 60 and "capacity" in a.body["error"]["message"]
        stored = server.call(server.gateway.store.get_reply(shed[0].headers["x-reply-id"]))
        assert stored.state == ReplyState.SHED and stored.message_id == shed[0].headers["x-message-id"]
    else:
        assert all(a.status == 200 for a in free)  # nothing refused: served otherwise
        assert len(treated) >= len(free) // 10
        for a in treated:
            assert a.headers["x-fairway-fallback"] == treatment
    if treatment == "mini":
        for a in treated:
            assert a.body["model"] == MINI and a.headers["x-fairway-model"] == MINI
        untreated = [a for a in served if a not in treated]
        assert all(a.body["model"] == MODEL and a.headers["x-fairway-model"] == MODEL for a in untreated)
    if treatment == "shorten":
        for a in treated:
            assert a.body["usage"]["completion_tokens"] == SHORTER == int(a.headers["x-fairway-max-tokens"])
            assert a.body["context"]["max_tokens"] == SHORTER if "context" in a.body else True
    if flood_median > 2 * idle_p99 + STEP_SLACK_S or second_worst > idle_p99 + MAX_WAIT_S:
        others, paused = machine.others(began, ended), machine.paused(began, ended)
        if paused or others > OTHERS_MAX:
            pytest.skip(f"paid TTFT p99 {flood_p99:.3f} s against {idle_p99:.3f} s idle, not checked: other "
                        f"processes took {others:.0%} of the CPUs for a while, this test's were stopped "
                        f"{paused:.1f} s")
        raise AssertionError((treatment, flood_p99, idle_p99, sorted(a.ttft for a in paid)))


def test_a_shed_message_sent_again_once_there_is_room_is_answered(server) -> None:
    """Its first reply stays SHED; the resend (same message_id) gets a new reply to the same message."""
    server.gateway.router.settings.pressure.free_at_capacity = "shed"
    pressure = server.gateway.router.settings.pressure
    pressure.max_wait_s, before = -1.0, pressure.max_wait_s  # every free request is at capacity now
    body = chat("shed me, then answer me", 4, False, message_id=f"again-{time.time()}")
    auth = {"Authorization": f"Bearer {FREE_KEY}"}
    try:
        idle(server)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=30)
    finally:
        pressure.max_wait_s = before
    if refused.status_code == 200:
        pytest.skip("no drain rate measured yet: nothing is ever shed on missing data")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shed"
    again = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert again.status_code == 200, again.text
    store = server.gateway.store
    first = server.call(store.get_reply(refused.headers["x-reply-id"]))
    newest = server.call(store.get_reply_for_message(first.conversation_id, first.message_id))
    assert first.state == ReplyState.SHED and newest.id != first.id and newest.state == ReplyState.FINISHED


def test_past_the_main_models_quota_the_mini_pool_serves_at_its_own_price(server) -> None:
    auth = {"Authorization": f"Bearer {BUSINESS_KEY}"}
    answers = []
    for i in range(3):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=chat(f"quota {i}", 100, False),
                              headers=auth, timeout=30)
        assert response.status_code == 200, response.text
        answers.append(response)
    models = [(r.json()["model"], r.headers["x-fairway-model"], r.headers.get("x-fairway-fallback")) for r in answers]
    assert models[0] == (MODEL, MODEL, None)
    assert models[-1] == (MINI, MINI, "quota")  # 3 x 100 tokens and the prompts: over the 300 of the main model
    reply_id = answers[-1].json()["id"].removeprefix("chatcmpl-")

    def usage():
        return server.call(server.gateway.store.get_usage(reply_id))

    deadline = time.monotonic() + 10
    while usage() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    record = usage()
    assert record is not None and record.model == MINI
    assert record.cost == pytest.approx(MINI_PRICE.cost(record.prompt_tokens, record.cached_tokens,
                                                        record.completion_tokens))


def test_a_gateway_is_told_the_mini_models_own_price_on_its_command_line() -> None:
    """What the test above sets in code, a deployed `fairway gateway` takes as --model-price;
    a price it cannot read stops it with one line (exit 2) before it starts."""
    base = ["gateway", "--redis", "redis://127.0.0.1:1/0", "--database", "sqlite://"]
    args = build_parser().parse_args([*base, "--model-price", f"{MINI}=0.001,0.002", "--model-price",
                                      f"{MODEL}=0.01,0.03,0.004"])
    pricing = _server_options(args).pricing
    assert pricing.price(MINI) == MINI_PRICE and pricing.price(MODEL) == Price(0.01, 0.03, 0.004)
    assert pricing.price("another") == pricing.default
    bad = subprocess.run([sys.executable, "-m", "fairway.cli", *base, "--model-price", f"{MINI}=0.001"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--model-price" in bad.stderr, bad.stderr
