"""Uploaded files' records (owner, name, sniffed type, size, status and its reason) and which
conversations they are attached to, in the conversation store's database."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from fairway.retrieval.sql_index import SqlTables

from .listing import FilePage, FileQuery, UnknownCursor

metadata = sa.MetaData()

files = sa.Table(
    "files", metadata,
    sa.Column("file_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("filename", sa.Text, nullable=False),
    sa.Column("purpose", sa.String(64), nullable=False),
    sa.Column("content_type", sa.String(128), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # awaiting_upload | processing | ready | failed
    sa.Column("status_details", sa.Text, nullable=True),  # why it failed
    sa.Column("chunks", sa.Integer, nullable=False),
    sa.Column("object_key", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Index("ix_files_user_created", "user_id", "created_at"),
)

conversation_files = sa.Table(
    "conversation_files", metadata,
    sa.Column("conversation_id", sa.String(64), nullable=False),
    sa.Column("file_id", sa.String(64), nullable=False),
    sa.Column("attached_at", sa.Double, nullable=False),
    sa.PrimaryKeyConstraint("conversation_id", "file_id", name="pk_conversation_files"),
    sa.Index("ix_conversation_files_file", "file_id"),
)


_ATTACHED = sa.select(files).join(conversation_files, conversation_files.c.file_id == files.c.file_id).where(
    conversation_files.c.conversation_id == sa.bindparam("conversation_id"))


@dataclass(frozen=True)
class FileRecord:
    file_id: str
    user_id: str
    filename: str
    purpose: str
    content_type: str
    bytes: int
    status: str
    status_details: str | None
    chunks: int
    object_key: str
    created_at: float

    def openai(self) -> dict[str, Any]:
        """OpenAI's file object, plus the sniffed type and the chunk count."""
        return {"id": self.file_id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": self.status,
                "status_details": self.status_details, "content_type": self.content_type, "chunks": self.chunks}


class FileStore(SqlTables):
    metadata = metadata

    async def add(self, record: FileRecord) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(files).values(**vars(record)))

    async def get(self, file_id: str, user_id: str | None = None) -> FileRecord | None:
        """None when missing or (with user_id) another user's."""
        where = [files.c.file_id == file_id] + ([files.c.user_id == user_id] if user_id is not None else [])
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(files).where(*where))).first()
        return FileRecord(**row._mapping) if row else None

    async def existing(self, user_id: str, file_ids: Collection[str]) -> set[str]:
        """Which of these files the user still has, in one query."""
        if not file_ids:
            return set()
        query = sa.select(files.c.file_id).where(files.c.user_id == user_id, files.c.file_id.in_(list(file_ids)))
        async with self.engine.connect() as conn:
            return set((await conn.execute(query)).scalars())

    async def page(self, user_id: str, query: FileQuery) -> FilePage:
        """One page of the user's files, ordered by (created_at, file_id): the id breaks ties, so
        each file has one place and a cursor never skips or repeats one. UnknownCursor when
        `after` is not one of the user's files."""
        key = (files.c.created_at, files.c.file_id)
        where = [files.c.user_id == user_id]
        if query.purpose is not None:
            where.append(files.c.purpose == query.purpose)
        async with self.engine.connect() as conn:
            if query.after is not None:
                cursor = (await conn.execute(sa.select(*key).where(
                    files.c.file_id == query.after, files.c.user_id == user_id))).first()
                if cursor is None:
                    raise UnknownCursor(query.after)
                row, at = sa.tuple_(*key), sa.tuple_(*cursor)
                where.append(row > at if query.order == "asc" else row < at)
            by = [c.asc() if query.order == "asc" else c.desc() for c in key]
            rows = (await conn.execute(sa.select(files).where(*where).order_by(*by)
                                       .limit(query.limit + 1))).all()  # one more says whether more follow
        return FilePage([FileRecord(**r._mapping) for r in rows[:query.limit]], len(rows) > query.limit)

    async def usage(self, user_id: str) -> tuple[int, int]:
        """(files, bytes) the user holds."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(files.c.bytes), 0))
                                      .where(files.c.user_id == user_id))).one()
        return int(row[0]), int(row[1])

    async def set_status(self, file_id: str, status: str, details: str | None = None, *,
                         chunks: int | None = None, content_type: str | None = None,
                         size: int | None = None) -> None:
        values: dict[str, Any] = {"status": status, "status_details": details}
        if chunks is not None:
            values["chunks"] = chunks
        if content_type is not None:
            values["content_type"] = content_type
        if size is not None:
            values["bytes"] = size
        async with self.engine.begin() as conn:
            await conn.execute(sa.update(files).where(files.c.file_id == file_id).values(**values))

    async def delete(self, file_id: str, user_id: str) -> FileRecord | None:
        async with self.engine.begin() as conn:
            row = (await conn.execute(sa.delete(files).where(files.c.file_id == file_id, files.c.user_id == user_id)
                                      .returning(*files.c))).first()
            if row is not None:
                await conn.execute(sa.delete(conversation_files).where(conversation_files.c.file_id == file_id))
        return FileRecord(**row._mapping) if row else None

    async def detach_all(self, conversation_id: str) -> int:
        """The conversation is gone: its attachments go too (the files stay, the user's)."""
        async with self.engine.begin() as conn:
            result = await conn.execute(sa.delete(conversation_files)
                                        .where(conversation_files.c.conversation_id == conversation_id))
        return result.rowcount

    async def conversations_of(self, file_id: str) -> list[str]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(conversation_files.c.conversation_id)
                                       .where(conversation_files.c.file_id == file_id))).all()
        return [r.conversation_id for r in rows]

    async def attach(self, conversation_id: str, file_id: str) -> bool:
        """True when newly attached."""
        stmt = self.insert(conversation_files).values(
            conversation_id=conversation_id, file_id=file_id, attached_at=time.time()).on_conflict_do_nothing()
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount > 0

    async def attached(self, conversation_id: str) -> dict[str, FileRecord]:
        """The conversation's attached files that still exist, by id."""
        rows = await self.rows(_ATTACHED, {"conversation_id": conversation_id})
        return {r["file_id"]: FileRecord(**dict(r)) for r in rows}
