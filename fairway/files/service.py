"""Uploads: checked (size, quota, sniffed type), stored, then processed in the background
(status processing -> ready | failed with a reason): text read, chunked, embedded into the file's
partition of the vector index. Attaching a file to a conversation copies its chunks into the
conversation's partition, where each turn's question looks them up (source.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from fairway.conversation.entities import new_id
from fairway.retrieval import CONVERSATION_CHUNKS, FILE_CHUNKS, Embedder, Entry, VectorIndex

from . import sniff as kinds
from .extract import ExtractionFailed, ExtractLimits, chunk_pages, extract_pages, ocr_available
from .listing import FilePage, FileQuery
from .objects import ObjectStore
from .speech import speech_available
from .store import FileRecord, FileStore

log = logging.getLogger(__name__)

PURPOSES = ("multimodal_input", "assistants", "user_data", "file-search")


class FileRejected(Exception):
    """An upload refused: status, message, code and param for the OpenAI error."""

    def __init__(self, status: int, message: str, code: str, param: str | None = "file") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass
class FileSettings:
    max_file_bytes: int = 20 << 20
    max_user_bytes: int = 200 << 20
    max_user_files: int = 100
    chunk_chars: int = 1000
    chunk_overlap: int = 150
    limits: ExtractLimits = field(default_factory=ExtractLimits)
    retrieve_k: int = 4  # chunks per turn at most
    retrieve_min_score: float = 0.1
    retrieve_max_tokens: int = 800  # the chunks' budget in a turn's context
    presign_expires_s: int = 900


class FileService:
    def __init__(self, store: FileStore, objects: ObjectStore, index: VectorIndex,
                 embedder: Callable[[], Embedder], settings: FileSettings | None = None) -> None:
        self.store = store
        self.objects = objects
        self.index = index
        self._embedder = embedder
        self.settings = settings or FileSettings()
        self._tasks: set[asyncio.Task] = set()
        self.ocr_off = ocr_available()  # None, or why images cannot be read here
        self.speech_off = speech_available()  # None, or why recordings cannot be transcribed here

    async def init(self) -> None:
        await self.store.init()
        await self.index.init()
        init = getattr(self.objects, "init", None)
        if init is not None:
            await init()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()
        await self.index.close()

    async def embed(self, texts: list[str]):  # noqa: ANN201 - np.ndarray
        embedder = await asyncio.to_thread(self._embedder)
        return await asyncio.to_thread(embedder.embed, texts)

    # -- checks ------------------------------------------------------------------------------

    def check_type(self, content_type: str) -> None:
        if content_type in (kinds.TEXT, kinds.MARKDOWN, kinds.PDF):
            return
        if content_type in kinds.IMAGES:
            if self.ocr_off:
                raise FileRejected(415, f"Images cannot be read on this server: {self.ocr_off}.", "unsupported_file_type")
            return
        if content_type in kinds.AUDIO:
            if self.speech_off:
                raise FileRejected(415, f"Audio cannot be transcribed on this server: {self.speech_off}.",
                                   "unsupported_file_type")
            if content_type != kinds.WAV:
                raise FileRejected(415, f"Only WAV (PCM) recordings can be transcribed here; convert this "
                                        f"{content_type} file to WAV first.", "unsupported_file_type")
            return
        raise FileRejected(415, f"Files of type {content_type} are not supported: upload text (UTF-8), Markdown, "
                                "PDF, an image or a WAV recording.", "unsupported_file_type")

    async def check_room(self, user_id: str, size: int) -> None:
        s = self.settings
        if size > s.max_file_bytes:
            raise FileRejected(413, f"The file is {size} bytes; at most {s.max_file_bytes} are allowed.", "file_too_large")
        count, used = await self.store.usage(user_id)
        if count >= s.max_user_files:
            raise FileRejected(413, f"You already have {count} files, the most allowed; delete some first.",
                               "too_many_files")
        if used + size > s.max_user_bytes:
            raise FileRejected(413, f"Your files would take {used + size} bytes; at most {s.max_user_bytes} are "
                                    "allowed. Delete some first.", "storage_quota_exceeded")

    @staticmethod
    def check_purpose(purpose: str) -> None:
        if purpose not in PURPOSES:
            raise FileRejected(400, f"purpose must be one of {', '.join(PURPOSES)}.", "invalid_purpose", "purpose")

    # -- uploads -----------------------------------------------------------------------------

    def _record(self, user_id: str, filename: str, purpose: str, content_type: str, size: int,
                status: str) -> FileRecord:
        file_id = new_id("file")
        return FileRecord(file_id, user_id, filename[:255] or "upload", purpose, content_type, size, status, None, 0,
                          f"{user_id}/{file_id}", time.time())

    async def upload(self, user_id: str, filename: str, data: bytes, purpose: str) -> FileRecord:
        """Store the bytes and start processing; answers at once (status processing)."""
        self.check_purpose(purpose)
        await self.check_room(user_id, len(data))
        if not data:
            raise FileRejected(400, "The file is empty.", "empty_file")
        content_type = kinds.sniff(data, filename)
        self.check_type(content_type)
        record = self._record(user_id, filename, purpose, content_type, len(data), "processing")
        await self.objects.put(record.object_key, data, content_type)
        await self.store.add(record)
        self._process_later(record.file_id)
        return record

    async def create_upload(self, user_id: str, filename: str, size: int, purpose: str) -> tuple[FileRecord, str]:
        """A pre-signed upload: the record (awaiting_upload) and the URL the client PUTs the bytes
        to, straight into the object store; complete_upload() starts processing."""
        if not self.objects.presigned:
            raise FileRejected(400, "Pre-signed uploads need the S3 object store; upload through POST /v1/files.",
                               "presigned_upload_unavailable", None)
        self.check_purpose(purpose)
        await self.check_room(user_id, size)
        record = self._record(user_id, filename, purpose, "application/octet-stream", size, "awaiting_upload")
        url = self.objects.presign_put(record.object_key, "application/octet-stream", self.settings.presign_expires_s)
        await self.store.add(record)
        return record, url

    async def complete_upload(self, user_id: str, file_id: str) -> FileRecord | None:
        record = await self.store.get(file_id, user_id)
        if record is None:
            return None
        if record.status != "awaiting_upload":
            return record
        size = await self.objects.size(record.object_key)
        if size is None:
            raise FileRejected(400, "Nothing has been uploaded to this file's URL yet.", "upload_missing", None)
        if size > self.settings.max_file_bytes:
            await self.delete(user_id, file_id)
            raise FileRejected(413, f"The uploaded file is {size} bytes; at most {self.settings.max_file_bytes} "
                                    "are allowed.", "file_too_large")
        await self.store.set_status(file_id, "processing", size=size)
        self._process_later(file_id)
        return await self.store.get(file_id, user_id)

    def _process_later(self, file_id: str) -> None:
        task = asyncio.create_task(self.process(file_id), name=f"file-{file_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def process(self, file_id: str) -> None:
        """Read, chunk and embed the file; its status says how it went. Never raises."""
        record = await self.store.get(file_id)
        if record is None:
            return
        try:
            data = await self.objects.get(record.object_key, self.settings.max_file_bytes)
            content_type = kinds.sniff(data, record.filename)
            try:
                self.check_type(content_type)
            except FileRejected as e:
                raise ExtractionFailed(e.message) from None
            pages = await extract_pages(data, content_type, self.settings.limits)
            chunks = chunk_pages(pages, self.settings.chunk_chars, self.settings.chunk_overlap)
            if not chunks:
                raise ExtractionFailed("no text could be read from the file")
            vectors = await self.embed([c.text for c in chunks])
            await self.index.upsert(FILE_CHUNKS, file_id, [
                Entry(f"{file_id}:{c.n}", v, c.text, {"file_id": file_id, "filename": record.filename, "chunk": c.n,
                                                      "page": c.page})
                for c, v in zip(chunks, vectors, strict=True)])
            await self.store.set_status(file_id, "ready", chunks=len(chunks), content_type=content_type)
            if await self.store.get(file_id) is None:  # deleted while it was processed
                await self.index.delete_partition(FILE_CHUNKS, file_id)
        except ExtractionFailed as e:
            await self.store.set_status(file_id, "failed", str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("processing file %s failed", file_id)
            await self.store.set_status(file_id, "failed", f"processing failed: {type(e).__name__}")

    # -- reading and deleting ----------------------------------------------------------------

    async def get(self, user_id: str, file_id: str) -> FileRecord | None:
        return await self.store.get(file_id, user_id)

    async def existing(self, user_id: str, file_ids: Collection[str]) -> set[str]:
        """Which of these files the user still has (the others were deleted, or never theirs)."""
        return await self.store.existing(user_id, file_ids)

    async def page(self, user_id: str, query: FileQuery) -> FilePage:
        return await self.store.page(user_id, query)

    async def content(self, user_id: str, file_id: str) -> tuple[FileRecord, bytes] | None:
        record = await self.store.get(file_id, user_id)
        if record is None or record.status == "awaiting_upload":
            return None
        return record, await self.objects.get(record.object_key)

    async def delete(self, user_id: str, file_id: str) -> bool:
        conversations = await self.store.conversations_of(file_id)
        record = await self.store.delete(file_id, user_id)
        if record is None:
            return False
        keys = [f"{file_id}:{n}" for n in range(record.chunks)]
        for conversation_id in conversations:
            await self.index.delete(CONVERSATION_CHUNKS, conversation_id, keys)
        await self.index.delete_partition(FILE_CHUNKS, file_id)
        await self.objects.delete(record.object_key)
        return True

    async def forget_conversation(self, conversation_id: str) -> None:
        """A deleted conversation: its attachments and its copies of their chunks go; the files stay."""
        await self.store.detach_all(conversation_id)
        await self.index.delete_partition(CONVERSATION_CHUNKS, conversation_id)

    async def wait_processed(self) -> None:
        """Until every processing task of this process is done (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
