"""Files as a context source of the conversation service: a turn that attaches files copies their
chunks into the conversation's partition, and every turn of a conversation with files gets the
chunks nearest its question (within a token budget) right before it, not the whole files; the
reply's context info names each chunk used, so the answer can cite it."""

from __future__ import annotations

import logging

from fairway.conversation.extras import TurnExtras, TurnInfo
from fairway.retrieval import CONVERSATION_CHUNKS, FILE_CHUNKS

from .service import FileService

log = logging.getLogger(__name__)

HEADER = ("Excerpts from files the user attached, the ones nearest the question. Answer from them when they "
          "are relevant and cite the source in brackets, like [report.pdf, chunk 3].")


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
        if not attached or not turn.question.strip():
            return TurnExtras()
        s = files.settings
        vector = (await files.embed([turn.question]))[0]
        hits = await files.index.search(CONVERSATION_CHUNKS, turn.conversation_id, vector, s.retrieve_k,
                                        s.retrieve_min_score)
        parts, sources, used = [HEADER], [], 0
        for hit in hits:
            record = attached.get(hit.meta.get("file_id", ""))
            if record is None:  # deleted since
                continue
            page = hit.meta.get("page")
            label = f"[{record.filename}, chunk {hit.meta['chunk']}" + (f", page {page}]" if page else "]")
            cost = turn.count_tokens(hit.text) + 12
            if sources and used + cost > s.retrieve_max_tokens:
                break
            parts.append(f"{label}\n{hit.text}")
            sources.append({"file_id": record.file_id, "filename": record.filename, "chunk": hit.meta["chunk"],
                            "page": page, "score": round(hit.score, 4)})
            used += cost
        if not sources:
            return TurnExtras(info={"sources": []})
        return TurnExtras(retrieved=[{"role": "system", "content": "\n\n".join(parts)}], info={"sources": sources})
