"""The gateway's token writer (fairway/gateway/token_writer.py): the C writer and its Python twin
write the same bytes as the gateway's one rendering of a chunk (fairway/gateway/sse.py), as HTTP
chunks, only when they may."""

from __future__ import annotations

import pytest
from transports import RecordingTransport, dechunk

from fairway.gateway import token_writer
from fairway.gateway.sse import ReplyView, chunk, frame, http_chunk, token_template

NATIVE = token_writer.native_module()
IMPLEMENTATIONS = ["python"] + (["native"] if NATIVE is not None else [])

TEXTS = ["hello", " world", "", 'q"uote\\back', "line\nbreak\r\ttab\b\f", "\x00\x01\x1f\x7f", "é 漢字 😀 \u2028",
         "x" * 5000]
VIEW = ReplyView("rep_1", "conv_1", "msg_1", "smollm2", 1796060482)


def writer_class(kind: str) -> type:
    if kind == "native":
        assert NATIVE is not None
        return NATIVE.TokenWriter
    return token_writer.PyTokenWriter


def expected(view: ReplyView, n: int, text: str) -> bytes:
    return frame(chunk(view, {"content": text}, n), n)


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_writers_event_is_the_gateways_json_chunk(kind: str, text: str) -> None:
    writer = writer_class(kind)(token_template(VIEW))
    assert writer.chunk(42, text) == expected(VIEW, 42, text)  # byte for byte, whichever path sends it


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_writer_writes_its_event_as_one_http_chunk(kind: str, text: str) -> None:
    transport = RecordingTransport()
    writer = writer_class(kind)(token_template(VIEW), transport)
    assert writer(7, text) is True
    assert transport.written == [http_chunk(expected(VIEW, 7, text))]
    assert dechunk(transport.written[0]) == [expected(VIEW, 7, text)]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_the_template_is_cut_where_the_markers_are_whatever_the_view_holds(kind: str) -> None:
    """A model name or id that looks like a marker (the NUL that marks the text, the number that
    marks n) cannot be taken for one."""
    odd = ReplyView("rep_987654321987654321", "\x00", 'm"sg', "\x00", 987654321987654321)
    writer = writer_class(kind)(token_template(odd))
    for n, text in [(1, "a"), (987654321987654321, "\x00"), (12345, 'x"y')]:
        assert writer.chunk(n, text) == expected(odd, n, text)


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_writer_writes_only_while_open_and_the_connection_takes_it_at_once(kind: str) -> None:
    backlog = [0]
    transport = RecordingTransport(lambda: backlog[0])
    writer = writer_class(kind)(token_template(VIEW), transport, open=False)
    assert writer(1, "a") is False  # not open yet: the first chunk is not its to write
    writer.open = True
    assert writer(2, "b") is True
    backlog[0] = 10  # the connection has bytes waiting: writing now could pass flow control
    assert writer(3, "c") is False
    backlog[0] = 0
    transport.closing = True  # the client left
    assert writer(4, "d") is False
    assert writer_class(kind)(token_template(VIEW))(5, "e") is False  # no connection at all
    assert writer.text() == "b" and transport.tokens() == [(2, "b")]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_writer_keeps_the_replys_text_as_the_stream_sent_it(kind: str) -> None:
    """What the stream's task sent itself (add_text) and what the writer wrote, in order: the text
    the reply is saved with, and its length in characters (where a tool call sits in it)."""
    transport = RecordingTransport()
    writer = writer_class(kind)(token_template(VIEW), transport)
    assert writer.text() == "" and writer.chars == 0
    writer.add_text("Hé")
    for n, text in enumerate(TEXTS, 2):
        assert writer(n, text) is True
    writer.add_text("😀!")
    assert writer.text() == "Hé" + "".join(TEXTS) + "😀!"
    assert writer.chars == len(writer.text())


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_the_native_writer_speaks_the_relays_c_sink_protocol() -> None:
    """Its type carries the capsule the relay's C dispatcher looks for (fairway/csrc/token_sink.h):
    without it every event would cost a Python call."""
    from fairway.redis_client import dispatch

    assert type(NATIVE.TokenWriter.__token_sink__).__name__ == "PyCapsule"
    if dispatch.native_module() is not None:
        assert dispatch.native_module().Tap(NATIVE.TokenWriter(token_template(VIEW))).native is True

