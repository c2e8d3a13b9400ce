"""The multiplexed Redis connection against the real Redis: replies matched to callers under
concurrency, batches kept whole, errors in their place, and what callers see when the connection
is lost, refused or silent."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid

import pytest
import redis.asyncio as aioredis
from backends import missing
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fairway.redis_client import RedisMux, pack
from fairway.relay.errors import RelayUnavailable
from fairway.relay.redis_guard import guard

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def key() -> str:
    return f"mux-test:{uuid.uuid4().hex}"


@pytest.fixture
async def mux():
    m = RedisMux(REDIS_URL, socket_timeout_s=2.0)
    yield m
    await m.close()


def test_pack_is_resp() -> None:
    assert pack(["SET", "k", 1.5, b"\x00"]) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n1.5\r\n$1\r\n\x00\r\n"
    with pytest.raises(TypeError):
        pack(["SET", "k", None])
    with pytest.raises(TypeError, match="bool"):
        pack(["SET", "k", True])


def test_pack_writes_each_argument_as_its_text() -> None:
    """Numbers as Python writes them (repr), text as UTF-8, bytes as they are: the same bytes
    whichever packer (hiredis's in C, or the Python one) packs them."""
    values = [0, -7, 10**25, 0.1, 1 / 3, 2.5e-07, 1e16, -0.0, float("inf"), float("nan"), 123.0, "é😀", "", b"\r\n"]
    expected = b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in
                        [b"X", *(v if isinstance(v, bytes) else (v.encode() if isinstance(v, str) else repr(v).encode())
                                 for v in values)])
    assert pack(["X", *values]) == b"*%d\r\n" % (len(values) + 1) + expected


def test_a_call_assembled_from_parts_is_the_generic_packers() -> None:
    """A script call assembled from its items' parts (script_call), each part packed generically
    (pack_args) or filled into its format (args_format: some arguments packed in once, the others
    filled per call, as the replica packs a token), writes the bytes pack_call writes, for
    scripts, argument counts and fixed arguments in turn."""
    from fairway.redis_client.scripts import Script, args_format, pack_args, pack_call, script_call

    def filled(values: list[bytes], fixed: set[int]) -> bytes:
        template = args_format([v if i in fixed else None for i, v in enumerate(values)])
        return template % tuple(x for i, v in enumerate(values) if i not in fixed for x in (len(v), v))

    for source in ("return 1", "return 2"):
        script = Script(source)
        for keys, args in ((["a", "b", "c"], ["5", "1000", "t1\x1fé", "", "ids", "1,2"]), (["k"], ["x"]), (["k"], []),
                           (["%s"], ["100%", "%d%%", "%b"])):  # (a format's own character, fixed or filled)
            key_bytes, arg_bytes = [k.encode() for k in keys], [a.encode() for a in args]
            expected = pack_call(script, keys, args)
            assert script_call(script, [pack_args(keys)], [pack_args(args)], len(keys), len(args)) == expected
            for fixed in (set(), {0}, set(range(1, 8, 2)), set(range(8))):
                parts = [filled(key_bytes, fixed), filled(arg_bytes, fixed)]
                assert script_call(script, parts[:1], parts[1:], len(keys), len(args)) == expected, (keys, args, fixed)
            # Several items' parts, one after the other: their keys first, then their arguments.
            halves = [pack_args(keys[:1]), pack_args(keys[1:])], [pack_args(args[:2]), pack_args(args[2:])]
            assert script_call(script, *halves, len(keys), len(args)) == expected


async def test_concurrent_callers_each_get_their_own_reply(mux: RedisMux) -> None:
    keys = [key() for _ in range(200)]
    await asyncio.gather(*(mux.execute("SET", k, f"value of {k}", "EX", 60) for k in keys))
    got = await asyncio.gather(*(mux.execute("GET", k) for k in keys))
    assert got == [f"value of {k}" for k in keys]
    # What it wrote is in the database the URL names, as another client sees it.
    other = aioredis.from_url(REDIS_URL, decode_responses=True)
    assert await other.get(keys[7]) == f"value of {keys[7]}"
    await other.aclose()


async def test_a_transaction_stays_whole_among_concurrent_commands(mux: RedisMux) -> None:
    counter = key()

    async def transaction() -> list:
        *_, result = await mux.batch([["MULTI"], ["INCR", counter], ["INCR", counter], ["EXEC"]])
        return result

    results = await asyncio.gather(*(transaction() for _ in range(50)),
                                   *(mux.execute("GET", counter) for _ in range(50)))
    increments = sorted(tuple(r) for r in results[:50])
    assert increments == [(2 * i + 1, 2 * i + 2) for i in range(50)]  # never interleaved
    assert await mux.execute("GET", counter) == "100"
    await mux.execute("DEL", counter)


async def test_error_replies_come_back_in_their_place(mux: RedisMux) -> None:
    k = key()
    results = await mux.batch([["SET", k, "x"], ["INCR", k], ["EVALSHA", "0" * 40, 0], ["GET", k]])
    assert results[0] == "OK" and results[3] == "x"
    assert isinstance(results[1], ResponseError) and "not an integer" in str(results[1])
    assert isinstance(results[2], NoScriptError)
    *_, executed = await mux.batch([["MULTI"], ["SET", k, "y"], ["INCR", k], ["EXEC"]])
    assert executed[0] == "OK" and isinstance(executed[1], ResponseError)  # inside a transaction too
    with pytest.raises(ResponseError):
        await mux.execute("INCR", "a", "b")  # wrong number of arguments
    assert await mux.execute("PING") == "PONG"  # the connection carries on
    await mux.execute("DEL", k)


async def test_a_caller_that_gives_up_does_not_shift_the_replies(mux: RedisMux) -> None:
    k = key()
    await mux.execute("SET", k, "mine", "EX", 60)
    # BLPOP on an empty list holds the connection for 0.3 s; the caller is cancelled meanwhile.
    blocked = asyncio.ensure_future(mux.execute("BLPOP", key(), 0.3))
    await asyncio.sleep(0.05)
    blocked.cancel()
    assert await mux.execute("GET", k) == "mine"  # its reply, not BLPOP's late nil


async def test_a_killed_connection_is_replaced(mux: RedisMux) -> None:
    assert await mux.execute("PING") == "PONG"
    my_id = await mux.execute("CLIENT", "ID")
    admin = aioredis.from_url(REDIS_URL)
    await admin.execute_command("CLIENT", "KILL", "ID", my_id)
    await admin.aclose()
    await asyncio.sleep(0.05)
    assert await mux.execute("PING") == "PONG"  # a new connection
    assert await mux.execute("CLIENT", "ID") != my_id


async def test_a_command_in_flight_when_the_connection_dies_is_retried_or_fails_cleanly() -> None:
    mux = RedisMux(REDIS_URL, socket_timeout_s=2.0, retries=0)
    my_id = await mux.execute("CLIENT", "ID")
    blocked = asyncio.ensure_future(mux.execute("BLPOP", key(), 5))
    await asyncio.sleep(0.05)
    admin = aioredis.from_url(REDIS_URL)
    await admin.execute_command("CLIENT", "KILL", "ID", my_id)
    await admin.aclose()
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(blocked, 2)
    assert await mux.execute("PING") == "PONG"
    await mux.close()


async def test_unreachable_redis_fails_fast() -> None:
    mux = RedisMux("redis://127.0.0.1:1/0", connect_timeout_s=0.5, retries=1, backoff_s=0.01)
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(mux.execute("PING"), 3)
    await mux.close()


async def test_a_silent_server_times_out_every_waiting_command() -> None:
    async def accept_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    mux = RedisMux(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.4)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(*(mux.execute("PING") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RedisTimeoutError) for r in results)
    assert loop.time() - started < 2.0
    await mux.close()
    server.close()


async def test_a_redis_still_loading_its_data_is_a_connection_error_to_retry() -> None:
    """After a restart Redis answers LOADING until its append-only file is read: callers see a
    connection error (the relay's guard makes it RelayUnavailable, which replicas and gateways
    retry), not a command error that ends the loop that made the call."""
    async def loading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(1 << 16):
            writer.write(b"-LOADING Redis is loading the dataset in memory\r\n" * chunk.count(b"*"))

    server = await asyncio.start_server(loading, "127.0.0.1", 0)
    mux = RedisMux(f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}", socket_timeout_s=1.0)
    try:
        with pytest.raises(RedisConnectionError, match="LOADING"):
            await asyncio.wait_for(mux.execute("PING"), 5)
        with pytest.raises(RelayUnavailable):
            with guard():
                await asyncio.wait_for(mux.execute("PING"), 5)
    finally:
        await mux.close()
        server.close()


async def test_a_unix_socket_url_reaches_the_redis_listening_there(tmp_path) -> None:
    server = shutil.which("redis-server")
    if server is None:
        missing("Redis", "redis-server is not installed")
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            await asyncio.sleep(0.05)
        mux = RedisMux(f"unix://{sock}?db=2")
        await mux.execute("SET", "k", "on the socket")
        assert await mux.execute("GET", "k") == "on the socket"
        assert " db=2 " in await mux.execute("CLIENT", "INFO")  # the URL's database
        await mux.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
