"""What an upload is, from its first bytes (never from its name or the client's content type)."""

from __future__ import annotations

PDF, TEXT, MARKDOWN, PNG, JPEG, GIF, WEBP, TIFF = ("application/pdf", "text/plain", "text/markdown", "image/png",
                                                   "image/jpeg", "image/gif", "image/webp", "image/tiff")
WAV = "audio/wav"
AUDIO = (WAV, "audio/mpeg", "audio/ogg", "audio/flac", "audio/mp4", "audio/webm")
IMAGES = (PNG, JPEG, GIF, WEBP, TIFF)

_MAGIC: list[tuple[bytes, int, str]] = [
    (b"%PDF-", 0, PDF), (b"\x89PNG\r\n\x1a\n", 0, PNG), (b"\xff\xd8\xff", 0, JPEG), (b"GIF8", 0, GIF),
    (b"WEBP", 8, WEBP), (b"II*\x00", 0, TIFF), (b"MM\x00*", 0, TIFF), (b"WAVE", 8, WAV),
    (b"ID3", 0, "audio/mpeg"), (b"\xff\xfb", 0, "audio/mpeg"), (b"OggS", 0, "audio/ogg"), (b"fLaC", 0, "audio/flac"),
    # A voice note: an iPhone's .m4a, a browser's MediaRecorder (WebM/Matroska, audio or not: read as audio).
    (b"ftypM4A", 4, "audio/mp4"), (b"\x1a\x45\xdf\xa3", 0, "audio/webm"),
    (b"PK\x03\x04", 0, "application/zip"), (b"\x1f\x8b", 0, "application/gzip"),
]


def sniff(data: bytes, filename: str = "") -> str:
    """The content type of data: a known signature, else text when it decodes as UTF-8 without
    control bytes (Markdown when the name says .md), else application/octet-stream."""
    for magic, offset, kind in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return kind
    head = data[:65536]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the sample's end
            return "application/octet-stream"
        text = head[: e.start].decode("utf-8")
    if any(ord(c) < 32 and c not in "\t\n\r\f" for c in text):
        return "application/octet-stream"
    return MARKDOWN if filename.lower().endswith((".md", ".markdown")) else TEXT
