"""A streamed reply's token writer: the token sink (relay.TokenSink) the SSE relay gives its token
log, which writes each token event it takes as an SSE event in an HTTP/1.1 chunk straight to the
response's connection, with no task wake, while the stream's task waits for events.

The writer comes from csrc/token_writer.c, compiled on first use, whose type also speaks the relay's
C-level sink protocol (fairway/csrc/token_sink.h), so the relay's C dispatcher hands it events
without a Python object per event; a machine without a C compiler, or with FAIRWAY_NATIVE_RELAY=0,
gets PyTokenWriter below, which writes the same bytes (tests hold the two to them).
"""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from fairway.gateway.sse import TokenTemplate, http_chunk
from fairway.native_build import load_extension

_SOURCE = Path(__file__).parent / "csrc" / "token_writer.c"


class PyTokenWriter:
    """chunk(n, text) is token n's SSE event; writer(n, text) writes it to transport as one HTTP
    chunk, only while the writer is open and the transport open with nothing buffered (so it never
    reorders bytes nor writes past flow control), and then keeps the text: text() is the reply's
    text so far, the tokens written here and those the stream's task sent itself (add_text), and
    chars its length. False: not written (the stream's task sends it through the server)."""

    def __init__(self, template: TokenTemplate, transport: asyncio.WriteTransport | None = None,
                 open: bool = True) -> None:
        self.template = template
        self.transport = transport
        self.open = open
        self._texts: list[str] = []

    def chunk(self, n: int, text: str) -> bytes:
        return self.template.event(n, text)

    def add_text(self, text: str) -> None:
        self._texts.append(text)

    @property
    def chars(self) -> int:
        return sum(map(len, self._texts))

    def text(self) -> str:
        return "".join(self._texts)

    def __call__(self, n: int, text: str) -> bool:
        transport = self.transport
        if not self.open or transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return False
        transport.write(http_chunk(self.chunk(n, text)))
        self.add_text(text)
        return True


@cache
def native_module() -> ModuleType | None:
    """The compiled module, or None (no compiler, a failed build, or turned off)."""
    return load_extension("fairway_token_writer", _SOURCE)


def writer_class() -> type:
    module = native_module()
    return module.TokenWriter if module is not None else PyTokenWriter


def make_writer(template: TokenTemplate, transport: asyncio.WriteTransport | None = None, open: bool = True) -> Any:
    return writer_class()(template, transport, open)
