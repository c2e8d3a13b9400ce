"""What an in-process queue's consumers wait on (the job queue's and the inbox's)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


def new_signal() -> asyncio.Event:
    return asyncio.Event()


@dataclass
class Arrivals:
    """A signal set, and replaced, whenever something is added: everyone waiting on the old one
    wakes; later waiters get a fresh one."""

    arrived: asyncio.Event = field(default_factory=new_signal)

    def notify(self) -> None:
        self.arrived.set()
        self.arrived = asyncio.Event()

    async def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ready() (True) or the timeout runs out (False; 0 = don't wait, None = no
        limit); ready() gets one last look after the timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not ready():
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)
        return True
