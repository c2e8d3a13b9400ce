"""The relay's per-event path: a Dispatcher turns a Pub/Sub connection's bytes into token events
handed, in order, to the sinks of the channels tapped into them (Tap), and the other messages.

Both come from csrc/live_dispatch.c, compiled on first use (see that file for why and how); a
machine without a C compiler, or with FAIRWAY_NATIVE_RELAY=0, gets the Python classes below,
which do the same (tests hold the two to the same behaviour), a few microseconds slower per event.
A sink is any relay.TokenSink; one whose type carries the C-level protocol of
fairway/csrc/token_sink.h is handed events by the C dispatcher without a Python object per event.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import hiredis

from fairway.native_build import load_extension
from fairway.relay.token_log import TokenSink

_SOURCE = Path(__file__).parent / "csrc" / "live_dispatch.c"
_IDS_END = "\x1f"  # between a token's ids and its text in a live payload (see redis_live.live_payload)


class PyTap:
    """One waiting subscriber's channel tapped into its sink: the dispatcher hands the sink token
    cursor + 1 when it arrives and, once the sink took it, moves cursor there and notes the feed's
    `now` in last."""

    __slots__ = ("sink", "cursor", "last")
    native = False  # (the C Tap's: whether it hands events through the sink's C-level protocol)

    def __init__(self, sink: TokenSink) -> None:
        if not callable(sink):
            raise TypeError("a tap's sink must be callable")
        self.sink = sink
        self.cursor = 0
        self.last = 0.0


class PyDispatcher:
    """feed(data, now): the RESP2 messages in data, token messages for a tap handed to its sink,
    the rest returned parsed (error replies as error_class instances)."""

    def __init__(self, taps: dict[str, Any], error_class: type[Exception]) -> None:
        self.taps = taps
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace", replyError=error_class)

    def feed(self, data: bytes, now: float) -> list[Any]:
        self._reader.feed(data)
        rest = []
        while (message := self._reader.gets()) is not False:
            if not self._take(message, now):
                rest.append(message)
        return rest

    def _take(self, message: Any, now: float) -> bool:
        if not isinstance(message, list) or len(message) != 3 or message[0] != "smessage":
            return False
        tap = self.taps.get(message[1])
        n, _, payload = message[2].partition(" ")
        if not isinstance(tap, PyTap) or not payload.startswith("t") or not n.isdigit() or int(n) != tap.cursor + 1:
            return False
        _, sep, text = payload.partition(_IDS_END)
        try:
            took = bool(sep) and bool(tap.sink(int(n), text))
        except Exception:  # as in C: the subscriber's own task meets the error, not every subscriber
            return False
        if took:
            tap.cursor, tap.last = int(n), now
        return took


@cache
def native_module() -> ModuleType | None:
    """The compiled module, or None (no compiler, a failed build, or turned off)."""
    return load_extension("fairway_live_dispatch", _SOURCE)


def tap_class() -> type:
    module = native_module()
    return module.Tap if module is not None else PyTap


def dispatcher_class() -> type:
    module = native_module()
    return module.Dispatcher if module is not None else PyDispatcher
