"""A page of a user's files in OpenAI's list shape (GET /v1/files): `limit`, an `after` cursor (a
file id), `order` by created_at and a `purpose` filter; the body names its first and last ids and
whether more follow, which is what ends an SDK's auto-pagination."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # store.py pages with these types
    from .store import FileRecord

MAX_LIMIT = 10_000  # OpenAI's bound and default for files

Order = Literal["asc", "desc"]


class UnknownCursor(Exception):
    """`after` names no file of this user (never one, another user's, or deleted since)."""


@dataclass(frozen=True)
class FileQuery:
    limit: int = MAX_LIMIT
    after: str | None = None
    order: Order = "desc"
    purpose: str | None = None


@dataclass(frozen=True)
class FilePage:
    records: list[FileRecord]
    has_more: bool

    def openai(self) -> dict[str, Any]:
        data = [r.openai() for r in self.records]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": self.has_more}
