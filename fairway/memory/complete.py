"""The model behind memory extraction: one generation job on the background lane (after paid
and free work), placed by the router, its text read from the token log. Not stored as a reply of
any conversation: it is the server's own request, not the user's."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fairway.conversation.context_builder import ChatTokenizer
from fairway.conversation.entities import new_id
from fairway.relay import FinalEvent, Lane, Relay, TokenEvent
from fairway.replica.job import GenerationJob
from fairway.router import Router


class ModelUnavailable(RuntimeError):
    pass


def fit_prompt(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], budget: int) -> list[int]:
    """The prompt's ids, at most `budget` of them: the longest message (the transcript) loses its
    oldest lines after the first (its header), then the front of its last line, until it fits.
    A transcript sized in characters can be longer in tokens than a replica's window; cut here,
    the newest turns still reach the model instead of the whole job being refused."""
    messages = [dict(m) for m in messages]
    longest = max(range(len(messages)), key=lambda i: len(str(messages[i].get("content") or "")))
    while True:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        head, _, body = str(messages[longest].get("content") or "").partition("\n")
        if len(prompt) <= budget:
            return prompt
        if not body:
            raise ModelUnavailable(f"the extraction prompt has {len(prompt)} tokens; {budget} fit the window")
        # Characters to drop, from the prompt's characters per token (a few rounds at most).
        cut = (len(prompt) - budget) * (len(head) + len(body)) // len(prompt) + 1
        lines = body.split("\n")
        while len(lines) > 1 and cut > 0:
            cut -= len(lines.pop(0)) + 1
        if cut > 0:
            lines = [lines[0][cut:]]
        messages[longest]["content"] = "\n".join([head, *lines]) if lines[0] or len(lines) > 1 else head


class BackgroundCompleter:
    def __init__(self, relay: Relay, router: Router, tokenizer: ChatTokenizer, model: str,
                 max_tokens: int = 256) -> None:
        self.relay = relay
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        self.max_tokens = max_tokens

    async def ready(self) -> bool:
        """Whether a live replica serves the model (the idle pass waits for one rather than read
        messages it could only half extract)."""
        return any(r.model == self.model and not r.draining for r in await self.router.live())

    async def __call__(self, messages: list[dict[str, Any]]) -> str:
        prompt = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        replica = await self.router.place(self.model, prompt)
        if len(prompt) + self.max_tokens > replica.max_model_len:  # (rendered and encoded again only then)
            prompt = fit_prompt(self.tokenizer, messages, replica.max_model_len - self.max_tokens)
        job = GenerationJob(reply_id=new_id("memx"), model=self.model, prompt_token_ids=prompt,
                            sampling={"max_tokens": self.max_tokens, "temperature": 0.0},
                            lane=Lane.BACKGROUND.value, tier="background", submitted_at=time.time())
        await self.relay.launch(job.reply_id, job.to_dict(), job.lane, queue=replica.queue)
        parts: list[str] = []
        async with contextlib.aclosing(self.relay.log.subscribe(job.reply_id)) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    parts.append(event.text)
                elif isinstance(event, FinalEvent) and event.error:
                    raise ModelUnavailable(f"the extraction job failed: {event.error}")
        return "".join(parts)
