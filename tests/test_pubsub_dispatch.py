"""The sharded Pub/Sub dispatcher (fairway/redis_client/dispatch.py): the C Dispatcher and its Python twin
take the same messages, hand a tapped channel's token events in order to its sink, whatever the
sink is (a Python callable, or the gateway's token writer through the C-level sink protocol), and
return the rest parsed."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ResponseError
from transports import RecordingTransport

from fairway.gateway import token_writer
from fairway.gateway.sse import ReplyView, token_template
from fairway.redis_client import dispatch
from fairway.relay.events import TokenEvent
from fairway.relay.redis_live import live_payload

NATIVE = dispatch.native_module()
IMPLEMENTATIONS = ["python"] + (["native"] if NATIVE is not None else [])
WRITERS = ["python"] + (["native"] if token_writer.native_module() is not None else [])
VIEW = ReplyView("rep_1", "conv_1", "msg_1", "smollm2", 1796060482)


def classes(kind: str) -> tuple[type, Any]:
    """The tap class, and a dispatcher of these taps (channel -> tap) in the kind's own table."""
    if kind == "native":
        assert NATIVE is not None

        def native_dispatcher(taps: dict[str, Any], error_class: type[Exception]) -> Any:
            table = NATIVE.TapTable()
            for channel, tap in taps.items():
                table[channel] = tap
            return NATIVE.Dispatcher(table, error_class)

        return NATIVE.Tap, native_dispatcher
    return dispatch.PyTap, dispatch.PyDispatcher


def smessage(channel: str, payload: str) -> bytes:
    parts = [b"smessage", channel.encode(), payload.encode()]
    return b"*3\r\n" + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def token_message(channel: str, n: int, text: str, ids: list[int] | None = None) -> bytes:
    return smessage(channel, f"{n} " + live_payload(TokenEvent(n, text, ids or [n])))


class Sink:
    """A relay.TokenSink in Python: records what it took, refuses or raises for some n."""

    def __init__(self, refuse: set[int] = frozenset(), raise_on: set[int] = frozenset()) -> None:
        self.took: list[tuple[int, str]] = []
        self.refuse, self.raise_on = refuse, raise_on

    def __call__(self, n: int, text: str) -> bool:
        if n in self.raise_on:
            raise RuntimeError("the connection broke")
        if n in self.refuse:
            return False
        self.took.append((n, text))
        return True


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_hands_tapped_tokens_in_order_and_returns_the_rest(kind: str) -> None:
    tap_class, dispatcher_class = classes(kind)
    sink = Sink(refuse={4})
    tap = tap_class(sink)
    tap.cursor = 1
    dispatcher = dispatcher_class({"ch": tap}, ResponseError)
    data = b"".join([
        token_message("ch", 2, "two"),
        token_message("other", 1, "not tapped"),
        b"*3\r\n$10\r\nssubscribe\r\n$2\r\nzz\r\n:1\r\n",
        token_message("ch", 3, "three\n é"),
        token_message("ch", 3, "a duplicate"),
        token_message("ch", 4, "refused"),
        token_message("ch", 5, "after a refusal"),
        smessage("ch", '6 f{"k":"f"}'),
        b"-ERR something\r\n",
        b"*2\r\n*1\r\n:5\r\n$-1\r\n",
    ])
    rest = dispatcher.feed(data, 12.5)
    assert sink.took == [(2, "two"), (3, "three\n é")] and (tap.cursor, tap.last) == (3, 12.5)
    assert tap.native is False  # a Python sink is called
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
@pytest.mark.parametrize("writer", WRITERS)
def test_dispatcher_hands_tokens_to_the_gateways_writer_until_the_connection_has_a_backlog(
        kind: str, writer: str) -> None:
    """The SSE relay's sink: the C writer is handed each event through the C-level protocol by the
    C dispatcher (called by the Python one); either way it writes the events it takes, in order,
    and declines once the connection has bytes waiting, which the Python path then takes."""
    tap_class, dispatcher_class = classes(kind)
    transport = RecordingTransport(lambda: int(len(transport.written) >= 3))  # backlogged after 3 writes
    sink = token_writer.native_module().TokenWriter if writer == "native" else token_writer.PyTokenWriter
    tap = tap_class(sink(token_template(VIEW), transport))
    assert tap.native is (kind == writer == "native")
    rest = dispatcher_class({"ch": tap}, ResponseError).feed(
        b"".join(token_message("ch", n, f"<{n}> é") for n in range(1, 6)), 3.0)
    assert transport.tokens() == [(n, f"<{n}> é") for n in range(1, 4)] and tap.sink.text() == "<1> é<2> é<3> é"
    assert tap.sink.chars == len(tap.sink.text())  # counted from the bytes on the C path
    assert tap.cursor == 3 and [message[2] for message in rest] == ["4 t4\x1f<4> é", "5 t5\x1f<5> é"]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_leaves_a_raising_sink_to_the_python_path(kind: str) -> None:
    tap_class, dispatcher_class = classes(kind)
    tap = tap_class(Sink(raise_on={1}))
    rest = dispatcher_class({"ch": tap}, ResponseError).feed(token_message("ch", 1, "x"), 1.0)
    assert rest == [["smessage", "ch", "1 t1\x1fx"]] and tap.cursor == 0


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_dispatcher_takes_messages_split_anywhere(kind: str) -> None:
    """A socket read may end anywhere in a message: what one feed leaves waits for the next."""
    tap_class, dispatcher_class = classes(kind)
    messages = [token_message("ch", n, f"tok {n} é") for n in range(1, 6)] + [smessage("nobody", "1 t1\x1fx")]
    data = b"".join(messages)
    for cut in range(1, len(data)):
        sink = Sink()
        tap = tap_class(sink)
        dispatcher = dispatcher_class({"ch": tap}, ResponseError)
        rest: list[Any] = dispatcher.feed(data[:cut], 1.0) + dispatcher.feed(data[cut:], 2.0)
        assert sink.took == [(n, f"tok {n} é") for n in range(1, 6)] and tap.cursor == 5
        assert rest == [["smessage", "nobody", "1 t1\x1fx"]]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_tap_needs_a_callable_sink(kind: str) -> None:
    tap_class, _ = classes(kind)
    with pytest.raises(TypeError):
        tap_class("not a sink")


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_many_interleaved_channels_each_reach_their_own_tap(kind: str) -> None:
    """Channels as the relay names them (hash tags, ~50 bytes) and longer ones than a tap holds
    inline, a socket read interleaving them: each event reaches its channel's tap, in order."""
    tap_class, dispatcher_class = classes(kind)
    channels = [f"fairway:reply:{{rep_{i:024x}}}:live" for i in range(300)] + [f"{'x' * 80}{i}" for i in range(5)]
    sinks = {channel: Sink() for channel in channels}
    dispatcher = dispatcher_class({channel: tap_class(sink) for channel, sink in sinks.items()}, ResponseError)
    rest = dispatcher.feed(b"".join(token_message(c, n, f"{c[-8:]} {n}") for n in (1, 2) for c in channels), 1.0)
    assert rest == [] and all(sink.took == [(n, f"{c[-8:]} {n}") for n in (1, 2)] for c, sink in sinks.items())


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_the_tap_table_is_a_mapping_of_channels_to_taps() -> None:
    """What the live events code does with its taps (set, get, pop, del, clear), through a table
    that grows and drops deleted slots as taps come and go; a tap out of it is out of the
    dispatcher's reach."""
    table, sink = NATIVE.TapTable(), Sink()
    dispatcher = NATIVE.Dispatcher(table, ResponseError)
    taps = {f"ch{i}": NATIVE.Tap(Sink()) for i in range(2000)}
    for _ in range(3):  # set, then half of them out, in again
        for channel, tap in taps.items():
            table[channel] = tap
        for i in range(0, 2000, 2):
            assert table.pop(f"ch{i}") is taps[f"ch{i}"]
        assert len(table) == 1000 and "ch1" in table and "ch0" not in table and table.get("ch0") is None
    assert table["ch1"] is taps["ch1"] and table.get("ch0", "none") == "none" and table.pop("ch0", None) is None
    with pytest.raises(KeyError):
        del table["ch0"]
    with pytest.raises(ValueError):  # a tap is under one channel at a time
        table["another"] = taps["ch1"]
    with pytest.raises(TypeError):
        table["ch0"] = sink  # only Taps
    table["ch1"] = replacement = NATIVE.Tap(sink)
    assert dispatcher.feed(token_message("ch1", 1, "a"), 1.0) == [] and sink.took == [(1, "a")]
    table["another"] = taps["ch1"]  # out of the table when replaced: free to go under another channel
    del table["ch1"]
    assert dispatcher.feed(token_message("ch1", 2, "b"), 1.0) == [["smessage", "ch1", "2 t2\x1fb"]]
    assert replacement.cursor == 1 and sink.took == [(1, "a")]
    table.clear()
    assert len(table) == 0 and dispatcher.feed(token_message("ch3", 1, "c"), 1.0) == [["smessage", "ch3", "1 t1\x1fc"]]
    # A replacement when the table is full enough to grow first: the slots move under it, and the
    # key still ends up with one tap, the new one.
    few = {f"k{i}": NATIVE.Tap(Sink()) for i in range(4)}
    for channel, tap in few.items():
        table[channel] = tap
    table["k0"] = newer = NATIVE.Tap(Sink())
    assert len(table) == 4 and table["k0"] is newer
    assert all(table[f"k{i}"] is few[f"k{i}"] for i in range(1, 4))
    table["elsewhere"] = few["k0"]  # the replaced tap is out of the table
    assert table.pop("k0") is newer and "k0" not in table and len(table) == 4


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_native_dispatcher_rejects_bytes_that_are_not_resp() -> None:
    dispatcher = NATIVE.Dispatcher(NATIVE.TapTable(), ResponseError)
    with pytest.raises(ValueError, match="not RESP2"):
        dispatcher.feed(b"HTTP/1.1 400 Bad Request\r\n", 1.0)


@pytest.mark.parametrize("module", [dispatch, token_writer], ids=["dispatcher", "writer"])
def test_without_a_compiler_the_python_twins_are_used(module: Any, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Any) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FAIRWAY_CACHE_DIR", str(tmp_path))
    assert module.native_module.__wrapped__() is None
    monkeypatch.setenv("FAIRWAY_NATIVE_RELAY", "0")
    monkeypatch.delenv("CC")
    assert module.native_module.__wrapped__() is None

