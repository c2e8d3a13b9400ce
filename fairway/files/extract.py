"""The text of an upload, and its chunks.

Parsing untrusted files (a PDF can be a decompression bomb, an image billions of pixels) runs in
a child process with an address-space limit and a deadline: whatever the file does, the server
process neither blocks nor runs out of memory, and a failure is a reason on the file.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
from asyncio.subprocess import PIPE
from collections.abc import Callable
from dataclasses import dataclass

from . import sniff as kinds


class ExtractionFailed(ValueError):
    """The file could not be read; the message is the reason its status shows."""


@dataclass(frozen=True)
class ExtractLimits:
    max_pages: int = 500
    max_chars: int = 2_000_000  # text kept per file
    timeout_s: float = 60.0
    memory_bytes: int = 1 << 30  # the child's address space
    max_audio_s: float = 180.0  # a recording's length transcribed at most, so it fits in timeout_s


@dataclass(frozen=True)
class Chunk:
    n: int  # 0, 1, 2 ... in the file
    text: str
    page: int | None = None  # 1-based, for PDFs


def ocr_available() -> str | None:
    """None when images can be OCR'd here, else why not."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("pytesseract") is None:
        return "pytesseract is not installed (pip install 'fairway[ocr]')"
    if shutil.which("tesseract") is None:
        return "the tesseract program is not installed (apt-get install tesseract-ocr)"
    return None


def _pdf_pages(data: bytes, limits: ExtractLimits) -> list[tuple[int | None, str]]:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise ExtractionFailed("the PDF is encrypted")
        pages, size = [], 0
        for i, page in enumerate(reader.pages):
            if i >= limits.max_pages:
                break
            text = page.extract_text() or ""
            pages.append((i + 1, text))
            size += len(text)
            if size > limits.max_chars:
                break
    except (PdfReadError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ExtractionFailed):
            raise
        raise ExtractionFailed(f"the PDF could not be parsed: {e}") from None
    return pages


def _image_text(data: bytes) -> list[tuple[int | None, str]]:
    import pytesseract
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:  # Pillow refuses decompression bombs itself
            return [(None, pytesseract.image_to_string(image))]
    except (OSError, Image.DecompressionBombError, pytesseract.TesseractError) as e:
        raise ExtractionFailed(f"the image could not be read: {e}") from None


def _audio_text(data: bytes, limits: ExtractLimits) -> list[tuple[int | None, str]]:
    from .speech import transcribe

    try:
        return [(None, transcribe(data, limits.max_audio_s))]
    except ValueError as e:
        raise ExtractionFailed(str(e)) from None


def pages_of(data: bytes, content_type: str, limits: ExtractLimits) -> list[tuple[int | None, str]]:
    """(page, text) of a file, in this process."""
    if content_type == kinds.PDF:
        return _pdf_pages(data, limits)
    if content_type in kinds.IMAGES:
        return _image_text(data)
    if content_type == kinds.WAV:
        return _audio_text(data, limits)
    if content_type in (kinds.TEXT, kinds.MARKDOWN):
        return [(None, data.decode("utf-8", errors="replace")[: limits.max_chars])]
    raise ExtractionFailed(f"files of type {content_type} cannot be read")


def _limit_memory(memory_bytes: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before it runs
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return apply


async def extract_pages(data: bytes, content_type: str, limits: ExtractLimits) -> list[tuple[int | None, str]]:
    """pages_of in a child process (`python -m fairway.files.reader`: the bytes on its stdin, JSON
    on its stdout), bounded by limits; ExtractionFailed with the reason otherwise."""
    if content_type in (kinds.TEXT, kinds.MARKDOWN):
        return pages_of(data, content_type, limits)  # decoding text is safe and bounded here
    args = json.dumps({"type": content_type, "max_pages": limits.max_pages, "max_chars": limits.max_chars,
                       "max_audio_s": limits.max_audio_s})
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fairway.files.reader", args, stdin=PIPE, stdout=PIPE, stderr=PIPE,
        preexec_fn=_limit_memory(limits.memory_bytes))
    try:
        out, err = await asyncio.wait_for(child.communicate(data), limits.timeout_s)
    except TimeoutError:
        raise ExtractionFailed(f"reading the file took longer than {limits.timeout_s:g} s") from None
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    try:
        answer = json.loads(out)
    except ValueError:
        if b"MemoryError" in err:
            raise ExtractionFailed(f"reading the file needed more than {limits.memory_bytes >> 20} MiB") from None
        raise ExtractionFailed(f"the file's reader failed (exit {child.returncode})") from None
    if "error" in answer:
        raise ExtractionFailed(answer["error"])
    return [(page, text) for page, text in answer["pages"]]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def chunk_pages(pages: list[tuple[int | None, str]], max_chars: int = 1000, overlap: int = 150) -> list[Chunk]:
    """Chunks of at most max_chars, on paragraph then sentence boundaries where there are any,
    never across pages (so a chunk cites one page); each starts with the previous one's last
    ~overlap characters of its page, so a fact split by a boundary is still whole in one chunk."""
    chunks: list[Chunk] = []
    for page, text in pages:
        pieces: list[str] = []
        for paragraph in re.split(r"\n\s*\n", text):
            # A NUL (some PDFs' text layers hold them) is no text, and PostgreSQL cannot store one.
            paragraph = " ".join(paragraph.replace("\x00", " ").split())
            if not paragraph:
                continue
            for sentence in _SENTENCE_END.split(paragraph):
                while len(sentence) > max_chars:  # no boundary: cut
                    pieces.append(sentence[:max_chars])
                    sentence = sentence[max_chars - overlap :]
                pieces.append(sentence)
        current = ""
        for piece in pieces:
            if current and len(current) + 1 + len(piece) > max_chars:
                chunks.append(Chunk(len(chunks), current, page))
                tail = current[-overlap:]
                current = tail[tail.find(" ") + 1 :] if " " in tail else ""
            current = f"{current} {piece}".strip()
        if current:
            chunks.append(Chunk(len(chunks), current, page))
    return chunks
