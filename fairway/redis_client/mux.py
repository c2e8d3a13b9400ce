"""One multiplexed Redis connection for the commands every chat request sends.

Every caller shares one connection: a command's bytes are written at once, its future waits in
a FIFO, and replies are parsed (hiredis) as they arrive and handed out in order, so commands
from concurrent requests share reads and wake-ups. redis-py's asyncio client checks a
connection out of its pool and runs several coroutine layers per command; bench/README.md has
the measured difference. A batch (a pipeline, or MULTI ... EXEC) is written in one piece, so no
other caller's command lands inside it.

Failures: a lost connection fails every command in flight with redis-py's ConnectionError, and
the next command connects afresh; a reply overdue by socket_timeout_s fails them all with its
TimeoutError (and drops the connection, whose replies would no longer match). Error replies come
back as redis-py's ResponseError (NoScriptError for NOSCRIPT), so callers handle both clients alike.
Blocking commands (BLMPOP, XREAD BLOCK) do not belong on the shared connection: they would hold
up everyone behind it (RedisClient gives them connections of their own). A connection can also
be handed over raw (connect_raw): after its setup, its bytes go to a callback unparsed, which is
how the Pub/Sub connection feeds the relay's dispatcher.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import BusyLoadingError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = Sequence[Any]


class _Reply(ResponseError):
    """An error reply, as hiredis builds it; turned into redis-py's class before it reaches a caller."""


def _error(reply: _Reply) -> ResponseError:
    message = str(reply)
    return NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)


def _loading(replies: list[Any]) -> ResponseError | None:
    """The LOADING error among the replies, if any: a Redis still reading its data after a restart
    ran none of the commands, and will shortly (a connection error to the caller, as redis-py
    has it, so that it retries)."""
    for reply in replies:
        if isinstance(reply, ResponseError) and str(reply).startswith("LOADING"):
            return reply
    return None


def _plain(reply: Any) -> Any:
    """The reply with its error replies as redis-py's exceptions. Errors sit at the top or, in an
    EXEC's array, one level down; a big reply (a log's replay) is not copied for nothing."""
    if isinstance(reply, _Reply):
        return _error(reply)
    if isinstance(reply, list) and any(isinstance(item, _Reply) for item in reply):
        return [_error(item) if isinstance(item, _Reply) else item for item in reply]
    return reply


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("a bool is not a Redis argument; send 0/1 or a string")
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise TypeError(f"{type(value).__name__} is not a Redis argument")


def pack(command: Command) -> bytes:
    """One command in RESP: packed by hiredis in C (the same bytes, a quarter of the time), or,
    for an argument it refuses, here, which says what is wrong with it."""
    try:
        return hiredis.pack_command(tuple(command))
    except TypeError:
        pass
    args = [_arg(a) for a in command]
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", replyError=_Reply)
        self.raw: Callable[[bytes], None] | None = None  # set: bytes go there unparsed (connect_raw)
        # One entry per batch written: (future, how many replies it takes, when it was written).
        self.waiting: deque[tuple[asyncio.Future[list[Any]], int, float]] = deque()
        self.replies: list[Any] = []  # of the batch at the head, so far
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.raw is not None:
            self.raw(data)
            return
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: the stream cannot be trusted
                self.fail(RedisConnectionError("Redis sent a reply nobody was waiting for"))
                return
            self.replies.append(reply)
            future, count, _ = self.waiting[0]
            if len(self.replies) == count:
                self.waiting.popleft()
                replies, self.replies = self.replies, []
                if not future.done():
                    future.set_result(replies)

    def request(self, data: bytes, count: int) -> asyncio.Future[list[Any]]:
        """Write a batch of count commands; the future gets their replies."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self.waiting.append((future, count, loop.time()))
        self.transport.write(data)
        return future

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis connection lost: {exc or 'closed by the server'}"))

    def fail(self, error: Exception) -> None:
        while self.waiting:
            future, _, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.close()
        if not self.closed.done():
            self.closed.set_result(None)


class RedisMux:
    """Commands over one shared connection to the Redis at `url` (redis://host:port/db)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 1.0, socket_timeout_s: float = 5.0,
                 retries: int = 1, backoff_s: float = 0.05) -> None:
        options = parse_url(url)  # redis://, rediss:// (TLS) and unix:// URLs, as redis-py reads them
        self._host = options.get("host", "127.0.0.1")
        self._port = int(options.get("port", 6379))
        self._path: str | None = options.get("path")  # a unix socket
        self._tls = options.get("connection_class") is SSLConnection
        self._setup: list[Command] = []
        if options.get("password") is not None:
            user = options.get("username")
            self._setup.append(["AUTH", *([user] if user else []), options["password"]])
        if options.get("db"):
            self._setup.append(["SELECT", int(options["db"])])
        self._connect_timeout_s = connect_timeout_s
        self._socket_timeout_s = socket_timeout_s
        # Like redis-py's Retry: a lost connection is retried on a new one after a short pause, so a
        # blip (a Redis restart) costs a delay, not an error. As there, a batch the dead connection
        # had already run is run again: the commands sent here are safe to repeat or, like a
        # window's count, err on the side of counting once too often.
        self._retries = retries
        self._backoff_s = backoff_s
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()
        self._watchdog: asyncio.TimerHandle | None = None

    async def execute(self, *command: Any) -> Any:
        """One command's reply; an error reply raised."""
        (reply,) = await self.batch([command])
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def batch(self, commands: Sequence[Command]) -> list[Any]:
        """The replies of commands written together (a pipeline; MULTI ... EXEC inside it stays
        whole), each error reply as an exception in its place."""
        return await self.batch_packed([pack(c) for c in commands])

    async def batch_packed(self, packed: Sequence[bytes]) -> list[Any]:
        """batch() of commands already packed (pack()): for callers that send the same commands
        again and again, such as heartbeats."""
        data = b"".join(packed)
        for attempt in range(self._retries + 1):
            try:
                replies = [_plain(reply) for reply in await self._send(data, len(packed))]
                if (loading := _loading(replies)) is not None:
                    raise BusyLoadingError(str(loading))
                return replies
            except RedisConnectionError:
                if attempt == self._retries:
                    raise
                await asyncio.sleep(self._backoff_s * (attempt + 1))
        raise AssertionError("unreachable")

    async def _send(self, data: bytes, count: int) -> list[Any]:
        protocol = self._protocol
        if protocol is None or protocol.closed.done():
            protocol = await self._connection()
        future = protocol.request(data, count)
        self._arm_watchdog()
        return await future

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._protocol is not None:
            self._protocol.fail(RedisConnectionError("the client was closed"))
            self._protocol = None

    async def _connection(self) -> _Protocol:
        """A live connection: the current one, or a new one if another caller has not made it yet."""
        async with self._connecting:
            if self._protocol is None or self._protocol.closed.done():
                self._protocol = await self._connect()
            return self._protocol

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        where = self._path or f"{self._host}:{self._port}"
        try:
            if self._path is not None:
                connecting = loop.create_unix_connection(_Protocol, self._path)
            else:
                connecting = loop.create_connection(_Protocol, self._host, self._port,
                                                    ssl=ssl.create_default_context() if self._tls else None)
            _, protocol = await asyncio.wait_for(connecting, self._connect_timeout_s)
        except TimeoutError as exc:
            raise RedisTimeoutError(f"Redis at {where} did not answer in time") from exc
        except OSError as exc:
            raise RedisConnectionError(f"Redis at {where} unreachable: {exc}") from exc
        if self._setup:
            future = protocol.request(b"".join(pack(c) for c in self._setup), len(self._setup))
            try:
                replies = await asyncio.wait_for(future, self._socket_timeout_s)
            except TimeoutError as exc:
                protocol.fail(RedisTimeoutError("Redis did not answer the connection setup"))
                raise RedisTimeoutError("Redis did not answer the connection setup") from exc
            errors = [r for r in replies if isinstance(r, ResponseError)]
            if errors:
                protocol.fail(RedisConnectionError(str(errors[0])))
                raise RedisConnectionError(f"Redis refused the connection setup: {errors[0]}")
        return protocol

    async def connect_raw(self, on_data: Callable[[bytes], None]) -> RawConnection:
        """A connection of its own, set up like this client's (AUTH, SELECT), whose bytes then go
        to on_data as they arrive, unparsed (for a Pub/Sub connection, in RESP2)."""
        protocol = await self._connect()
        protocol.raw = on_data
        return RawConnection(protocol)

    def _arm_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self._socket_timeout_s / 2, self._check)

    def _check(self) -> None:
        """Every socket_timeout_s / 2 while commands wait: fail them all if the oldest is overdue."""
        self._watchdog = None
        protocol = self._protocol
        if protocol is None or not protocol.waiting:
            return
        _, _, since = protocol.waiting[0]
        if asyncio.get_running_loop().time() - since > self._socket_timeout_s:
            protocol.fail(RedisTimeoutError(f"Redis did not answer within {self._socket_timeout_s} s"))
            return
        self._arm_watchdog()


class RawConnection:
    """A connection handed over raw (RedisMux.connect_raw): commands written, replies not read."""

    def __init__(self, protocol: _Protocol) -> None:
        self._protocol = protocol

    @property
    def closed(self) -> asyncio.Future[None]:
        """Done once the connection is lost or closed."""
        return self._protocol.closed

    def send(self, commands: Sequence[Command]) -> None:
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            raise RedisConnectionError("the connection is closed")
        transport.write(b"".join(pack(c) for c in commands))

    def close(self) -> None:
        self._protocol.fail(RedisConnectionError("the connection was closed"))
