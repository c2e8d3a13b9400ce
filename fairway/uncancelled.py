"""Work that must run to its end whoever cancels the task awaiting it: the cleanup a stream does
after its client left (the listener leaving, the reply's save). A disconnect cancels the stream's
task, and again while it has not ended; cut short inside a store's transaction, a write leaves its
connection torn (on SQLite the file locked for every other writer). A bottom module: any part may
import it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Strong references: a task the loop holds only weakly could be collected before it ends.
_running: set[asyncio.Future[Any]] = set()


async def finish_anyway(work: Coroutine[Any, Any, T]) -> T:
    """Await work in a task of its own: a cancel of the caller raises in the caller at once and
    leaves the work running to its end."""
    task = asyncio.ensure_future(work)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return await asyncio.shield(task)
