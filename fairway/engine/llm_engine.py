"""One replica's engine: add requests, abort them, and step the whole batch forward one token at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fairway.block_hash import BLOCK_SIZE
from fairway.domain import Priority
from fairway.engine.gpu_model_runner import GPUModelRunner
from fairway.engine.guided_decoding import Guides
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.model_runner import ModelRunner
from fairway.engine.outputs import FinishReason, Logprobs, RequestOutput
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.scheduler import Scheduler, SchedulerConfig
from fairway.engine.sequence import Sequence, SequenceStatus
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.engine.spec_decode.speculator import Speculator
from fairway.engine.stats import EngineStats
from fairway.engine.step_time import StepTimeModel
from fairway.engine.stop_checker import StopChecker
from fairway.models.llama import LlamaModel

DEFAULT_STEP_TIME_TARGET = {False: 0.050, True: 0.030}  # seconds, by whether the model is on a GPU


class RequestRejected(ValueError):
    """A request that can never run (too long for the context window or the KV cache); raised before admission."""


def check_continuation(num_output_tokens: int, params: SamplingParams) -> None:
    """Reject a continuation whose tokens already reach max_tokens: it has nothing left to
    generate (a replica that logged the last token and went before its final event), and run, it
    would sample one token past the limit."""
    if num_output_tokens >= params.max_tokens:
        raise RequestRejected(f"the {num_output_tokens} tokens it carries on after reach max_tokens "
                              f"({params.max_tokens})")


@dataclass
class EngineConfig:
    num_kv_blocks: int = 2048  # 16-token blocks: 32k token slots
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    reserve_blocks: int | None = None
    # bound_step_time: each step's time is bounded (scheduler.py): the target in seconds, None for
    # the device's default (50 ms on a CPU, 30 ms on a GPU, the seed's inter-token latency). On by
    # default since it meets its targets (bench/itl.py: ITL p99 within 2x p50 at 64 chats, within
    # 10% of the throughput); off leaves only the token budget.
    bound_step_time: bool = True
    step_time_target: float | None = None
    step_time_headroom: float = 1.5
    background_max_wait_s: float | None = 30.0  # background work waiting this long moves up a lane
    # Speculative decoding (None: off). On by default with prompt lookup: it needs no second model
    # and turns itself off per sequence and for large batches where it would not pay.
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig | None = None, tokenizer=None,
                 draft_model: LlamaModel | None = None, runner: ModelRunner | GPUModelRunner | None = None) -> None:
        """runner: by default the model's device's (GPUModelRunner on CUDA, ModelRunner elsewhere)."""
        self.config = config or EngineConfig()
        c = self.config
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = model.cfg.window(c.max_model_len)  # (past the model's: ValueError, unless allowed)
        for m in (model, draft_model):  # an allowed longer window: RoPE tables that cover it
            if m is not None:
                m.rotary = m.rotary.covering(self.max_model_len)
        self.kv = KVCacheManager(c.num_kv_blocks, c.block_size, c.reserve_blocks, c.enable_prefix_caching)
        if runner is None and model.embed_tokens.weight.device.type == "cuda":
            runner = GPUModelRunner(model, c.num_kv_blocks, c.block_size, c.max_num_seqs, self.max_model_len,
                                    max_num_batched_tokens=c.max_num_batched_tokens)
        self.runner = runner or ModelRunner(model, c.num_kv_blocks, c.block_size)
        self.step_time = StepTimeModel()
        target = c.step_time_target or DEFAULT_STEP_TIME_TARGET[self.runner.device.type == "cuda"]
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens,
                                                   target if c.bound_step_time else None, c.step_time_headroom,
                                                   c.background_max_wait_s),
                                   self.kv, self.step_time)
        self.requests: dict[str, Sequence] = {}
        self._aborts: list[str] = []
        self._eos = set(tokenizer.stop_token_ids) if tokenizer is not None else set()
        self.guides = Guides(tokenizer, model.cfg.vocab_size)  # compiled grammars of guided requests
        self.num_steps = 0
        self.step_seconds = 0.0
        self.speculator = None if c.speculative is None else Speculator.build(
            c.speculative, model, self.kv, self.step_time, self.max_model_len, draft_model)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = Priority.PAID, arrival: float | None = None,
                    output_token_ids: list[int] | None = None) -> None:
        """Queue a request. output_token_ids: tokens it generated already (elsewhere: a replica
        that died mid-reply); it carries on after them as if it had never stopped. They count
        towards max_tokens, the stop strings see their text, and a seeded sampler is wound on past
        their draws; only the tokens after them come out."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        output_token_ids = output_token_ids or []
        tokens = [*prompt_token_ids, *output_token_ids]
        self.check_prompt(len(tokens))
        check_continuation(len(output_token_ids), params)
        if any(not 0 <= t < self.model.cfg.vocab_size for t in tokens):
            raise ValueError("prompt contains token ids outside the vocabulary")
        if any(t >= self.model.cfg.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias names token ids outside the vocabulary (0..{self.model.cfg.vocab_size - 1})")
        seq = Sequence(request_id, tokens, params, priority=priority,
                       arrival=arrival if arrival is not None else time.monotonic(),
                       num_prompt_tokens=len(prompt_token_ids))
        seq.stop_checker = StopChecker(params, self.tokenizer)
        seq.resume_after(output_token_ids)
        if params.guided_decoding is not None:
            seq.guide = self.guides.matcher(params.guided_decoding)  # GuidedDecodingError (a ValueError)
            if output_token_ids:  # a continuation: the grammar is where those tokens left it
                seq.guide.consume_tokens(list(output_token_ids))
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this engine can ever run: the context window and the KV cache both
        need room for it plus at least one generated token."""
        return min(self.max_model_len, self.kv.max_admissible_tokens()) - 1

    def check_prompt(self, num_tokens: int) -> None:
        """Reject a prompt that could never run, so it fails now instead of waiting forever."""
        if num_tokens == 0:
            raise RequestRejected("prompt is empty")
        if num_tokens >= self.max_model_len:
            raise RequestRejected(f"prompt has {num_tokens} tokens; the context window is "
                                  f"{self.max_model_len} tokens including at least one generated token")
        if num_tokens + 1 > self.kv.max_admissible_tokens():
            raise RequestRejected(f"prompt has {num_tokens} tokens; the KV cache holds at most "
                                  f"{self.kv.max_admissible_tokens()} tokens for one request")

    def abort(self, request_id: str) -> None:
        """The sequence leaves at the next step and its blocks are freed; unknown ids are ignored."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborts)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._process_aborts()
        self._propose()
        t1 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.empty:
            decode_rows = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                              if n == 1 or seq.is_decoding)
            draft_rows = batch.draft_rows  # (before the step moves its sequences on)
            tokens = self.runner.execute(batch)
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                self._advance(seq, n, tokens.get(seq))
            now = time.monotonic()
            for seq, new in tokens.items():
                for token in new:
                    outputs.append(self._append_token(seq, token, now))
                    if seq.is_finished:  # a stop among accepted draft tokens: the rest are dropped
                        break
            self.num_steps += 1
            # The step-time model learns from the step's decode rows (draft rows included, and how many
            # of them were drafts) and prefill tokens.
            self.step_time.observe(decode_rows, sum(batch.num_new_tokens) - decode_rows, time.perf_counter() - t1,
                                   draft_rows)
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def _propose(self) -> None:
        if self.speculator is None:
            return
        decoding = [s for s in self.scheduler.running if s.is_decoding and s.can_speculate]
        self.speculator.propose(decoding, self.num_steps, self.scheduler.prefill_tokens_next())

    def _advance(self, seq: Sequence, n: int, new: list[int] | None) -> None:
        """Count the step's computed tokens. Of a sequence's draft tokens only the accepted ones
        count: the K/V of the rest is rolled back (their slots are free to overwrite, blocks that
        held nothing else go back to the pool), and only full blocks of accepted tokens are hashed."""
        drafts = seq.num_computed_tokens + n - seq.num_tokens
        if drafts <= 0:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
            return
        accepted = len(new) - 1 if new else 0
        seq.num_computed_tokens += n - drafts + accepted
        self.kv.cache_full_blocks(seq, new[:accepted] if new else None)
        self.kv.trim(seq)
        seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed_tokens)
        self.speculator.record(seq, drafts, accepted)
        seq.spec_token_ids.clear()

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        logprobs, seq.step_logprobs = seq.step_logprobs, None
        if seq.guide is not None:
            seq.guide.consume_token(token)
        if seq.adjust is not None:
            seq.adjust.add(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        else:
            seq.inter_token_times.append(now - seq.last_token_time)
        seq.last_token_time = now
        finish = None
        if not seq.params.ignore_eos and token in self._eos or token in seq.params.stop_token_ids:
            finish = FinishReason.STOP
        text, stop_hit = seq.stop_checker.add(token, is_stop_token=finish is not None)
        if stop_hit:
            finish = FinishReason.STOP
        elif finish is None and (seq.num_output_tokens >= seq.params.max_tokens
                                 or seq.num_tokens >= self.max_model_len):
            finish = FinishReason.LENGTH
        if finish is not None:
            text += seq.stop_checker.flush() if not stop_hit else ""
            self._finish(seq, finish)
        return self._output(seq, token, text, finish, logprobs)

    def _process_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborts:
            seq = self.requests.get(rid)
            if seq is None:
                continue
            self._finish(seq, FinishReason.ABORT)
            outputs.append(self._output(seq, None, "", FinishReason.ABORT))
        self._aborts.clear()
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def _output(self, seq: Sequence, token: int | None, text: str, finish: FinishReason | None,
                logprobs: Logprobs | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, token_id=token, text=text, finish_reason=finish,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, ttft=seq.ttft,
            inter_token_times=list(seq.inter_token_times) if finish is not None else None, logprobs=logprobs)

    # --- counters -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        running = self.scheduler.running
        pool = self.kv.pool
        used = self.kv.num_used_blocks
        return EngineStats(
            num_running=len(running), num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=pool.num_blocks, kv_blocks_used=used,
            kv_slots_total=pool.num_blocks * pool.block_size, kv_slots_used=used * pool.block_size,
            kv_tokens_live=sum(s.num_tokens for s in running),
            prefix_cache_queries=self.kv.query_tokens, prefix_cache_hits=self.kv.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            step_seconds=self.step_seconds, forward_seconds=self.runner.forward_seconds,
            **self._spec_stats())

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        spec = self.speculator
        return {"spec_decode_num_drafts": spec.num_drafts, "spec_decode_num_draft_tokens": spec.num_draft_tokens,
                "spec_decode_num_accepted_tokens": spec.num_accepted_tokens}

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (offline use and tests); returns the generated token ids of each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.token_id is not None and out.request_id in result:
                    result[out.request_id].append(out.token_id)
        return [result[rid] for rid in ids]

