"""A test engine whose replies are scripted: LLMEngine's interface as AsyncEngine drives it (add,
step, abort, stats), with each reply's text chosen by a function of the prompt, tokenized by the
real tokenizer and emitted one token per step. It makes the model's part of a test deterministic
(a tool call, then an answer built from the tool's output); the replica worker, the relay, the
gateway, the store and the sandbox around it stay the real ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fairway.domain import FinishReason
from fairway.engine import RequestOutput, RequestRejected, SamplingParams
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.stats import EngineStats


@dataclass
class _Reply:
    ids: list[int]
    prompt: int
    params: SamplingParams
    sent: int = 0
    aborted: bool = False


class ScriptedEngine:
    def __init__(self, tokenizer, script: Callable[[str], str], max_model_len: int = 4096,
                 step_s: float = 0.002) -> None:
        self.tokenizer = tokenizer
        self.script = script  # the prompt's text -> the reply's text
        self.max_model_len = max_model_len
        self.step_s = step_s  # a step's time: the engine thread must not spin
        self.prompts: list[tuple[str, list[int]]] = []  # every request: (id, prompt ids), in order
        self.kv = KVCacheManager(64, 16, 0, True)  # holds nothing: what the replica reads of an engine's cache
        self._replies: dict[str, _Reply] = {}
        self._steps = 0

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1

    def check_prompt(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise RequestRejected(f"the prompt has {num_tokens} tokens; the window is {self.max_model_len}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, output_token_ids: list[int] | None = None) -> None:
        prompt_token_ids = [*prompt_token_ids, *(output_token_ids or [])]  # (a continuation: what came before)
        self.prompts.append((request_id, list(prompt_token_ids)))
        text = self.script(self.tokenizer.decode(prompt_token_ids))
        ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        self._replies[request_id] = _Reply(ids, len(prompt_token_ids), params or SamplingParams())

    def abort(self, request_id: str) -> None:
        if request_id in self._replies:
            self._replies[request_id].aborted = True

    def has_unfinished(self) -> bool:
        return bool(self._replies)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        self._steps += 1
        outputs = []
        for request_id, reply in list(self._replies.items()):
            if reply.aborted:
                outputs.append(RequestOutput(request_id, None, "", FinishReason.ABORT, reply.prompt, 0, reply.sent))
                del self._replies[request_id]
                continue
            token = reply.ids[reply.sent]
            reply.sent += 1
            last = reply.sent == len(reply.ids)
            at_length = reply.sent >= reply.params.max_tokens
            text = "" if last else self._delta(reply.ids, reply.sent)
            finish = FinishReason.STOP if last else FinishReason.LENGTH if at_length else None
            outputs.append(RequestOutput(request_id, token, text, finish, reply.prompt, 0, reply.sent))
            if finish is not None:
                del self._replies[request_id]
        return outputs

    def _delta(self, ids: list[int], upto: int) -> str:
        return self.tokenizer.decode(ids[:upto])[len(self.tokenizer.decode(ids[:upto - 1])):]

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._replies), num_waiting=0, kv_blocks_total=1, kv_blocks_used=0,
                           kv_slots_total=16, kv_slots_used=0, kv_tokens_live=0, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, num_steps=self._steps, step_seconds=0.0,
                           forward_seconds=0.0)
