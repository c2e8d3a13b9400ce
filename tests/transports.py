"""A stand-in for the writing half of an asyncio transport, for the gateway's token writer: it
records what was written and reads the token events back out of the HTTP chunks."""

from __future__ import annotations

import json
from collections.abc import Callable


def token_of(event: bytes) -> tuple[int, str]:
    """(n, text) of a plain token's SSE event."""
    chunk = json.loads(event.split(b"data: ", 1)[1])
    return int(chunk["choices"][0]["checkpoint_id"].removeprefix("tok_")), chunk["choices"][0]["delta"]["content"]


def dechunk(raw: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 chunks in raw, which holds whole chunks only."""
    bodies = []
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line, 16)
        assert raw[size:size + 2] == b"\r\n"
        bodies.append(raw[:size])
        raw = raw[size + 2:]
    return bodies


class RecordingTransport:
    """backlog(): what get_write_buffer_size() says (0: a writer may write), asked before each
    write; written: each write's bytes."""

    def __init__(self, backlog: Callable[[], int] = lambda: 0) -> None:
        self.backlog = backlog
        self.closing = False
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.backlog()

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def events(self) -> list[bytes]:
        """The SSE events written, one HTTP chunk each."""
        bodies = [body for data in self.written for body in dechunk(data)]
        assert len(bodies) == len(self.written)
        return bodies

    def tokens(self) -> list[tuple[int, str]]:
        return [token_of(event) for event in self.events()]
