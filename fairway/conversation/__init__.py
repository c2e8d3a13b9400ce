"""Conversations, messages and replies: one store interface, SQLite or PostgreSQL behind it."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import make_url

from .entities import (
    ApiKey,
    Attachment,
    Conversation,
    Message,
    MessageStatus,
    Reply,
    ReplyState,
    Role,
    UsageRecord,
)
from .sql_store import SqlConversationStore
from .store import (
    ConversationBusy,
    ConversationStore,
    DuplicateClientKey,
    DuplicateKey,
    InvalidText,
    NotFound,
    ReplyFinished,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "ApiKey",
    "Attachment",
    "Conversation",
    "ConversationBusy",
    "ConversationStore",
    "DuplicateClientKey",
    "DuplicateKey",
    "InvalidText",
    "Message",
    "MessageStatus",
    "NotFound",
    "Reply",
    "ReplyFinished",
    "ReplyState",
    "Role",
    "SqlConversationStore",
    "StoreError",
    "StoreUnavailable",
    "UsageRecord",
    "database_url",
    "make_store",
]

DEFAULT_SQLITE_PATH = Path(".fairway") / "fairway.db"

# Plain URLs (as in DATABASE_URL conventions) mapped onto the async drivers we ship.
_ASYNC_DRIVERS = {
    "postgresql://": "postgresql+asyncpg://",
    "postgres://": "postgresql+asyncpg://",
    "sqlite://": "sqlite+aiosqlite://",
}


def database_url(url: str | None = None) -> str:
    """The async SQLAlchemy URL for `url`; the embedded SQLite file when none is given."""
    if not url:
        # Absolute, so a later chdir does not open a second, empty database.
        return f"sqlite+aiosqlite:///{DEFAULT_SQLITE_PATH.resolve()}"
    for plain, driver in _ASYNC_DRIVERS.items():
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


def make_store(url: str | None = None) -> ConversationStore:
    """A store for `url` (SQLite file ./.fairway/fairway.db by default; a PostgreSQL URL may carry
    libpq's parameters, connect_params.py). Call `await store.init()` before use to create or
    upgrade the schema. ValueError, at once, for a parameter the driver cannot take."""
    full = database_url(url)
    parsed = make_url(full)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    return SqlConversationStore(full)
