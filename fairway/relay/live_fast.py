"""The relay's per-event path: Tap (one stream's token chunks) and Dispatcher (Pub/Sub bytes to taps).

Both come from csrc/live_fast.c, compiled on first use (see that file for why and how); a machine
without a C compiler, or with FAIRWAY_NATIVE_RELAY=0, gets the Python classes below, which do the
same (tests hold the two to the same bytes), a few microseconds slower per event.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import subprocess
import sysconfig
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import hiredis

from fairway.native_build import build_cached

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "live_fast.c"
_IDS_END = "\x1f"  # between a token's ids and its text in a live payload (see redis_live.live_payload)
_json_string = json.JSONEncoder(ensure_ascii=False).encode
_TAIL = '},"finish_reason":null,"logprobs":null,"checkpoint_id":"tok_'

Write = Callable[[bytes], bool]


class PyTap:
    """One waiting stream's fast path (see csrc/live_fast.c): chunk(n, text) is token n's SSE event;
    tap(n, text) writes it (with write, or as an HTTP chunk straight to transport while that is
    open and has no backlog) and, when written, keeps the text in texts."""

    def __init__(self, head: bytes, write: Write, texts: list[str], open: bool = True,
                 transport: asyncio.WriteTransport | None = None) -> None:
        self._head = head.decode()
        self.write = write
        self.texts = texts
        self.open = open
        self.transport = transport
        self.cursor = 0  # n of the last token taken from a dispatcher
        self.last = 0.0  # the `now` of the feed that took it

    def chunk(self, n: int, text: str) -> bytes:
        return f"id: {n}\ndata: {self._head}{_json_string(text)}{_TAIL}{n}\"}}]}}\n\n".encode()

    def __call__(self, n: int, text: str) -> bool:
        if not self.open:
            return False
        chunk = self.chunk(n, text)
        if self.transport is not None:
            if self.transport.is_closing() or self.transport.get_write_buffer_size():
                return False
            self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        elif not self.write(chunk):
            return False
        self.texts.append(text)
        return True


class PyDispatcher:
    """feed(data, now): the RESP2 messages in data, token messages for a tap written by it, the rest
    returned parsed (error replies as error_class instances)."""

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
        if tap is None or not payload.startswith("t") or not n.isdigit() or int(n) != tap.cursor + 1:
            return False
        _, sep, text = payload.partition(_IDS_END)
        try:
            took = bool(sep) and tap(int(n), text)
        except Exception:  # as in C: the stream's own task meets the error, not every stream
            return False
        if took:
            tap.cursor, tap.last = int(n), now
        return took


def native_relay_enabled() -> bool:
    return os.environ.get("FAIRWAY_NATIVE_RELAY", "1") != "0"


@cache
def native_module() -> ModuleType | None:
    """The compiled module, or None (no compiler, a failed build, or turned off)."""
    if not native_relay_enabled():
        return None
    include = sysconfig.get_paths()["include"]
    try:
        path = build_cached("fairway_live_fast", [_SOURCE], ["-O2", "-fPIC", "-shared", "-std=c11", f"-I{include}"],
                            [sysconfig.get_config_var("EXT_SUFFIX") or "", include],
                            suffix=sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        spec = importlib.util.spec_from_file_location("fairway_live_fast", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("the relay's C path was not built (%s): using its Python path", detail[:500])
        return None


def tap_class() -> type:
    module = native_module()
    return module.Tap if module is not None else PyTap


def dispatcher_class() -> type:
    module = native_module()
    return module.Dispatcher if module is not None else PyDispatcher


def make_tap(head: bytes, write: Write, texts: list[str], open: bool = True,
             transport: asyncio.WriteTransport | None = None) -> Any:
    return tap_class()(head, write, texts, open, transport)


def is_tap(sink: object) -> bool:
    """A sink this process's dispatchers write to by themselves (LiveEvents registers it while its
    stream waits); any other sink is called from Python."""
    return isinstance(sink, tap_class())
