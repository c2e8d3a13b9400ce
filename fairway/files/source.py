"""Files as a context source of the conversation service: a turn that attaches files copies their
chunks into the conversation's partition, and every turn of a conversation with files gets the
chunks nearest its question (within a token budget) right before it, not the whole files; the
reply's context info names each chunk used, so the answer can cite it. A turn that attaches files
with no question (a file dropped in and sent), or with one no chunk is near ("summarise this"),
gets their opening chunks instead, within the same budget: the model sees what was sent."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fairway.conversation.extras import TurnExtras, TurnInfo
from fairway.retrieval import CONVERSATION_CHUNKS, FILE_CHUNKS

from .opening import Chunk, opening_chunks
from .service import FileService
from .store import FileRecord

log = logging.getLogger(__name__)

HEADER = ("Excerpts from files the user attached, the ones nearest the question. Answer from them when they "
          "are relevant and cite the source in brackets, like [report.pdf, chunk 3].")
OPENING_HEADER = ("The beginning of the files the user attached, in document order. Answer from them and cite the "
                  "source in brackets, like [report.pdf, chunk 0].")
LABEL_TOKENS = 12  # what a chunk's label and separators cost on top of its text


class FileSource:
    def __init__(self, service: FileService) -> None:
        self.service = service

    async def extras(self, turn: TurnInfo) -> TurnExtras:
        files = self.service
        if turn.new_conversation and not turn.file_ids:
            return TurnExtras()  # nothing can be attached to it yet
        for file_id in turn.file_ids:  # the gateway checked they are the user's and ready
            if await files.store.attach(turn.conversation_id, file_id):
                await files.index.copy_partition(FILE_CHUNKS, file_id, CONVERSATION_CHUNKS, turn.conversation_id)
        attached = await files.store.attached(turn.conversation_id)
        if not attached:
            return TurnExtras()
        sent = [attached[f] for f in dict.fromkeys(turn.file_ids) if f in attached]  # attached by this turn
        if turn.question.strip():
            nearest = await self._nearest(turn, attached)
            if nearest.info["sources"] or not sent:
                return nearest
            # Nothing near the question in the files it sends ("summarise this"): their beginning.
        return await self._opening(turn, sent)

    async def _nearest(self, turn: TurnInfo, attached: dict[str, FileRecord]) -> TurnExtras:
        """The attached chunks nearest the question, best first, within the budget."""
        files, s = self.service, self.service.settings
        vector = (await files.embed([turn.question]))[0]
        hits = await files.index.search(CONVERSATION_CHUNKS, turn.conversation_id, vector, s.retrieve_k,
                                        s.retrieve_min_score)
        excerpts = _Excerpts(turn, s.retrieve_max_tokens)
        for hit in hits:
            record = attached.get(hit.meta.get("file_id", ""))
            if record is None:  # deleted since
                continue
            if not excerpts.add(record, Chunk(hit.meta["chunk"], hit.text, hit.meta.get("page")), hit.score):
                break
        return excerpts.extras(HEADER)

    async def _opening(self, turn: TurnInfo, records: list[FileRecord]) -> TurnExtras:
        """The files this turn attaches, each from its start: their first chunks in turns (every
        file's chunk 0, then every file's chunk 1, ...) so one long file does not crowd out the
        others, shown file by file in document order."""
        files, s = self.service, self.service.settings
        if not records:
            return TurnExtras()  # no question and no file of its own: nothing to show
        most = s.retrieve_max_tokens // (LABEL_TOKENS + 1) + 1  # each costs more than LABEL_TOKENS: no more could fit
        openings = [await opening_chunks(files.index, r.file_id, min(r.chunks, most)) for r in records]
        excerpts = _Excerpts(turn, s.retrieve_max_tokens)
        in_turns = ((record, chunks[n]) for n in range(max(map(len, openings)))
                    for record, chunks in zip(records, openings, strict=True) if n < len(chunks))
        for record, chunk in in_turns:
            if not excerpts.add(record, chunk, None):
                break
        place = {r.file_id: i for i, r in enumerate(records)}
        excerpts.sort(lambda source: (place[source["file_id"]], source["chunk"]))
        return excerpts.extras(OPENING_HEADER)


class _Excerpts:
    """Chunks chosen for a turn, labelled for citing, within a token budget (the first always
    goes in, so a turn with files never shows none)."""

    def __init__(self, turn: TurnInfo, budget: int) -> None:
        self.turn, self.budget, self.used = turn, budget, 0
        self.parts: list[str] = []
        self.sources: list[dict[str, Any]] = []

    def add(self, record: FileRecord, chunk: Chunk, score: float | None) -> bool:
        """False when it does not fit: the budget is spent."""
        cost = self.turn.count_tokens(chunk.text) + LABEL_TOKENS
        if self.sources and self.used + cost > self.budget:
            return False
        label = f"[{record.filename}, chunk {chunk.n}" + (f", page {chunk.page}]" if chunk.page else "]")
        self.parts.append(f"{label}\n{chunk.text}")
        self.sources.append({"file_id": record.file_id, "filename": record.filename, "chunk": chunk.n,
                             "page": chunk.page, "score": None if score is None else round(score, 4)})
        self.used += cost
        return True

    def sort(self, key: Callable[[dict[str, Any]], Any]) -> None:
        """Reorder the chosen chunks by their sources."""
        pairs = sorted(zip(self.parts, self.sources, strict=True), key=lambda p: key(p[1]))
        self.parts, self.sources = [p for p, _ in pairs], [s for _, s in pairs]

    def extras(self, header: str) -> TurnExtras:
        """The chunks as one system message right before the turn, named in the reply's context."""
        if not self.sources:
            return TurnExtras(info={"sources": []})
        return TurnExtras(retrieved=[{"role": "system", "content": "\n\n".join([header, *self.parts])}],
                          info={"sources": self.sources})
