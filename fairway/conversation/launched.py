"""The replies this process launched, remembered until their end is recorded.

A reply's end is written by two parties (recorder.py): the gateway relaying it, and whichever
gateway's recorder takes the replica's report, which then reads the reply's stored job back for
accounting. When both are this process, it already knows what the store would say: the job it
stored at launch (never changed after), and that its relay saved the reply, so the recorder's
save would be a no-op. Each is a statement a chat request need not send. Only a cache: a reply
forgotten (evicted, another process's) is read from and written to the store as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fairway.conversation.store import ConversationStore

DEFAULT_MAX_ENTRIES = 32_768  # replies in flight at once, with room; the oldest go first past it


@dataclass
class _Launched:
    job: dict[str, Any]  # as stored with the reply (model, sampling, the gateway's meta)
    saved: bool = False  # its message is in the store: this process's relay saved it


class LaunchedReplies:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Launched] = OrderedDict()

    def add(self, reply_id: str, job: dict[str, Any]) -> None:
        self._entries[reply_id] = _Launched(job)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def mark_saved(self, reply_id: str) -> None:
        """The reply's final message is stored (the second save of it changes nothing)."""
        if (entry := self._entries.get(reply_id)) is not None:
            entry.saved = True

    def saved(self, reply_id: str) -> bool:
        entry = self._entries.get(reply_id)
        return entry is not None and entry.saved

    def forget(self, reply_ids: Iterable[str]) -> None:
        """Its end is recorded: nothing will ask again."""
        for reply_id in reply_ids:
            self._entries.pop(reply_id, None)

    def __contains__(self, reply_id: object) -> bool:
        return reply_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    async def jobs(self, store: ConversationStore, reply_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """store.get_reply_jobs(reply_ids), the ones launched here from memory."""
        jobs = {i: entry.job for i in reply_ids if (entry := self._entries.get(i)) is not None}
        unknown = [i for i in reply_ids if i not in jobs]
        if unknown:
            jobs.update(await store.get_reply_jobs(unknown))
        return jobs
