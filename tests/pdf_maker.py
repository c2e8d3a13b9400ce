"""Test helper: a small valid PDF with one text page per string (Helvetica), written by hand so the
tests need no PDF library beyond the pypdf that reads it; and a decompression-bomb PDF."""

from __future__ import annotations

import zlib


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _document(page_streams: list[bytes], filters: str = "") -> bytes:
    n = len(page_streams)
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, stream in enumerate(page_streams):
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> "
                       f">> /Contents {5 + 2 * i} 0 R >>".encode())
        objects.append(f"<< /Length {len(stream)}{filters} >>\nstream\n".encode() + stream + b"\nendstream")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects):
        offsets.append(len(out))
        out += f"{i + 1} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def make_pdf(pages: list[str]) -> bytes:
    streams = []
    for text in pages:
        lines = [text[i : i + 80] for i in range(0, len(text), 80)] or [""]
        ops = ["BT", "/F1 11 Tf", "14 TL", "50 740 Td"] + [f"({_escape(line)}) Tj T*" for line in lines] + ["ET"]
        streams.append("\n".join(ops).encode("latin-1"))
    return _document(streams)


def bomb_pdf(decompressed_mib: int = 400) -> bytes:
    """One page whose Flate content stream inflates to decompressed_mib MiB of spaces."""
    packer = zlib.compressobj(9)
    block = b" " * (1 << 20)
    stream = b"".join(packer.compress(block) for _ in range(decompressed_mib)) + packer.flush()
    return _document([stream], " /Filter /FlateDecode")
