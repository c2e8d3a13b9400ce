"""Facts about a user across conversations: extraction, deduplicated storage, injection."""

from __future__ import annotations

from .complete import BackgroundCompleter
from .service import MemoryBlock, MemoryService, MemorySettings, readable
from .source import MemorySource
from .store import Memory, MemoryStore

__all__ = ["BackgroundCompleter", "Memory", "MemoryBlock", "MemoryService", "MemorySettings", "MemorySource",
           "MemoryStore", "readable"]
