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
        job = GenerationJob(reply_id=new_id("memx"), model=self.model, prompt_token_ids=prompt,
                            sampling={"max_tokens": self.max_tokens, "temperature": 0.0},
                            lane=Lane.BACKGROUND.value, tier="background", submitted_at=time.time())
        replica = await self.router.place(self.model, prompt)
        await self.relay.launch(job.reply_id, job.to_dict(), job.lane, queue=replica.queue)
        parts: list[str] = []
        async with contextlib.aclosing(self.relay.log.subscribe(job.reply_id)) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    parts.append(event.text)
                elif isinstance(event, FinalEvent) and event.error:
                    raise ModelUnavailable(f"the extraction job failed: {event.error}")
        return "".join(parts)
