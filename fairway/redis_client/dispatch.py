"""A sharded Pub/Sub connection's reader: a Dispatcher turns the connection's bytes into its
messages, and hands each sequenced text message of a tapped channel, in order, to that channel's
sink (Tap); the other messages it returns parsed.

A dispatcher finds a channel's tap in its taps, which tap_table() makes (see csrc/dispatch.c's
TapTable for why it is not a dict in C).

A sequenced text message is the payload "<n> t<head>\x1f<text>" (sequenced_text() writes what
follows "<n> "): n numbers the channel's messages, head is the publisher's (the relay puts a
token's ids there), text may hold anything. A tap takes message cursor + 1 only, so a sink never
sees one out of order; anything else is the caller's to handle.

Both come from csrc/dispatch.c, compiled on first use (see that file for why and how); a machine
without a C compiler, or with FAIRWAY_NATIVE_RELAY=0, gets the Python classes below, which do the
same (tests hold the two to the same behaviour). A sink is any callable sink(n, text) -> bool
(True: taken); one whose type carries the C-level protocol of fairway/csrc/token_sink.h is
handed messages by the C dispatcher without a Python object per message.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import hiredis

from fairway.native_build import load_extension

_SOURCE = Path(__file__).parent / "csrc" / "dispatch.c"
TEXT = "t"  # what starts a sequenced text message's payload after "<n> "
HEAD_END = "\x1f"  # between its head and its text: the head must not hold it

Sink = Callable[[int, str], bool]


def sequenced_text(head: str, text: str) -> str:
    """The payload a tap hands to its sink as (n, text), once the publisher put "<n> " before it."""
    return f"{TEXT}{head}{HEAD_END}{text}"


class PyTap:
    """One waiting subscriber's channel tapped into its sink: the dispatcher hands the sink token
    cursor + 1 when it arrives and, once the sink took it, moves cursor there and notes the feed's
    `now` in last."""

    __slots__ = ("sink", "cursor", "last")
    native = False  # (the C Tap's: whether it hands events through the sink's C-level protocol)

    def __init__(self, sink: Sink) -> None:
        if not callable(sink):
            raise TypeError("a tap's sink must be callable")
        self.sink = sink
        self.cursor = 0
        self.last = 0.0


class PyDispatcher:
    """feed(data, now): the RESP2 messages in data, token messages for a tap handed to its sink,
    the rest returned parsed (error replies as error_class instances)."""

    def __init__(self, taps: MutableMapping[str, Any], error_class: type[Exception]) -> None:
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
        if not isinstance(tap, PyTap) or not payload.startswith(TEXT) or not n.isdigit() or int(n) != tap.cursor + 1:
            return False
        _, sep, text = payload.partition(HEAD_END)
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
    return load_extension("fairway_redis_dispatch", _SOURCE)


def tap_class() -> type:
    module = native_module()
    return module.Tap if module is not None else PyTap


def dispatcher_class() -> type:
    module = native_module()
    return module.Dispatcher if module is not None else PyDispatcher


def tap_table() -> MutableMapping[str, Any]:
    """An empty channel -> tap mapping for a dispatcher_class() dispatcher: the C TapTable (a
    dict's get, pop, del, clear and setting, found by the channel's bytes in C), or a dict."""
    module = native_module()
    return module.TapTable() if module is not None else {}
