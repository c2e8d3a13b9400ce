"""The relay's per-event path (fairway/relay/live_fast.py): the C Tap and Dispatcher and their
Python twins give the same bytes and take the same events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis.exceptions import ResponseError

from fairway.gateway.streaming import ReplyRelay, ReplyView, chunk_head, frame
from fairway.relay import live_fast
from fairway.relay.events import TokenEvent
from fairway.relay.redis_live import live_payload

NATIVE = live_fast.native_module()
IMPLEMENTATIONS = ["python"] + (["native"] if NATIVE is not None else [])

TEXTS = ["hello", " world", "", 'q"uote\\back', "line\nbreak\r\ttab\b\f", "\x00\x01\x1f\x7f", "é 漢字 😀 \u2028",
         "x" * 5000]
VIEW = ReplyView("rep_1", "conv_1", "msg_1", "smollm2", 1796060482)


def classes(kind: str) -> tuple[type, type]:
    if kind == "native":
        assert NATIVE is not None
        return NATIVE.Tap, NATIVE.Dispatcher
    return live_fast.PyTap, live_fast.PyDispatcher


def smessage(channel: str, payload: str) -> bytes:
    parts = [b"smessage", channel.encode(), payload.encode()]
    return b"*3\r\n" + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def token_message(channel: str, n: int, text: str, ids: list[int] | None = None) -> bytes:
    return smessage(channel, f"{n} " + live_payload(TokenEvent(n, text, ids or [n])))


class Writes:
    def __init__(self, refuse: set[int] = frozenset(), raise_on: set[int] = frozenset()) -> None:
        self.chunks: list[bytes] = []
        self.refuse, self.raise_on = refuse, raise_on

    def __call__(self, body: bytes) -> bool:
        n = json.loads(body.split(b"data: ", 1)[1])["choices"][0]["checkpoint_id"]
        n = int(n.removeprefix("tok_"))
        if n in self.raise_on:
            raise RuntimeError("the connection broke")
        if n in self.refuse:
            return False
        self.chunks.append(body)
        return True


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_taps_chunk_is_the_gateways_json_chunk(kind: str, text: str) -> None:
    tap_class, _ = classes(kind)
    tap = tap_class(chunk_head(VIEW), Writes(), [])
    relay = ReplyRelay.__new__(ReplyRelay)
    expected = frame(relay._chunk(VIEW, {"content": text}, 42, {}), 42)
    assert tap.chunk(42, text) == expected  # byte for byte: the same event whichever path sent it


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
@pytest.mark.parametrize("text", TEXTS)
def test_native_and_python_taps_write_the_same_bytes(text: str) -> None:
    assert NATIVE.Tap(b"{", Writes(), []).chunk(7, text) == live_fast.PyTap(b"{", Writes(), []).chunk(7, text)


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_tap_called_as_a_sink_writes_and_keeps_the_text(kind: str) -> None:
    tap_class, _ = classes(kind)
    texts: list[str] = ["earlier"]
    writes = Writes(refuse={3})
    tap = tap_class(chunk_head(VIEW), writes, texts, open=False)
    assert tap(1, "a") is False and writes.chunks == []  # not open yet: the first chunk is not its to write
    tap.open = True
    assert tap(2, "b") is True and tap(3, "c") is False
    assert texts == ["earlier", "b"] and len(writes.chunks) == 1


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_writes_tapped_tokens_in_order_and_returns_the_rest(kind: str) -> None:
    tap_class, dispatcher_class = classes(kind)
    texts: list[str] = []
    writes = Writes(refuse={4})
    tap = tap_class(chunk_head(VIEW), writes, texts)
    tap.cursor = 1
    dispatcher = dispatcher_class({"ch": tap}, ResponseError)
    data = b"".join([
        token_message("ch", 2, "two"),
        token_message("other", 1, "not tapped"),
        b"*3\r\n$10\r\nssubscribe\r\n$2\r\nzz\r\n:1\r\n",
        token_message("ch", 3, "three\n"),
        token_message("ch", 3, "a duplicate"),
        token_message("ch", 4, "refused"),
        token_message("ch", 5, "after a refusal"),
        smessage("ch", '6 f{"k":"f"}'),
        b"-ERR something\r\n",
        b"*2\r\n*1\r\n:5\r\n$-1\r\n",
    ])
    rest = dispatcher.feed(data, 12.5)
    assert texts == ["two", "three\n"] and (tap.cursor, tap.last) == (3, 12.5)
    assert [json.loads(c.split(b"data: ", 1)[1])["choices"][0]["delta"]["content"] for c in writes.chunks] == \
        ["two", "three\n"]
    error = rest.pop(6)
    assert isinstance(error, ResponseError) and str(error) == "ERR something"
    assert rest == [
        ["smessage", "other", "1 t1\x1fnot tapped"],
        ["ssubscribe", "zz", 1],
        ["smessage", "ch", "3 t3\x1fa duplicate"],
        ["smessage", "ch", "4 t4\x1frefused"],
        ["smessage", "ch", "5 t5\x1fafter a refusal"],
        ["smessage", "ch", '6 f{"k":"f"}'],
        [[5], None],
    ]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_leaves_a_raising_write_to_the_python_path(kind: str) -> None:
    tap_class, dispatcher_class = classes(kind)
    tap = tap_class(chunk_head(VIEW), Writes(raise_on={1}), [])
    rest = dispatcher_class({"ch": tap}, ResponseError).feed(token_message("ch", 1, "x"), 1.0)
    assert rest == [["smessage", "ch", "1 t1\x1fx"]] and tap.cursor == 0


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_takes_messages_split_anywhere(kind: str) -> None:
    """A socket read may end anywhere in a message: what one feed leaves waits for the next."""
    tap_class, dispatcher_class = classes(kind)
    messages = [token_message("ch", n, f"tok {n} é") for n in range(1, 6)] + [smessage("nobody", "1 t1\x1fx")]
    data = b"".join(messages)
    for cut in range(1, len(data)):
        texts: list[str] = []
        tap = tap_class(chunk_head(VIEW), Writes(), texts)
        dispatcher = dispatcher_class({"ch": tap}, ResponseError)
        rest: list[Any] = dispatcher.feed(data[:cut], 1.0) + dispatcher.feed(data[cut:], 2.0)
        assert texts == [f"tok {n} é" for n in range(1, 6)] and tap.cursor == 5
        assert rest == [["smessage", "nobody", "1 t1\x1fx"]]


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_native_dispatcher_rejects_bytes_that_are_not_resp() -> None:
    dispatcher = NATIVE.Dispatcher({}, ResponseError)
    with pytest.raises(ValueError, match="not RESP2"):
        dispatcher.feed(b"HTTP/1.1 400 Bad Request\r\n", 1.0)


def test_without_a_compiler_the_python_path_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FAIRWAY_CACHE_DIR", str(tmp_path))
    assert live_fast.native_module.__wrapped__() is None
    monkeypatch.setenv("FAIRWAY_NATIVE_RELAY", "0")
    monkeypatch.delenv("CC")
    assert live_fast.native_module.__wrapped__() is None
