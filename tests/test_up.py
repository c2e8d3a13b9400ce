"""`fairway up` as a user runs it: one command starts two gateways on one port and two
replicas on the local Redis and PostgreSQL, prints the URL and a key that the OpenAI SDK uses,
and Ctrl-C drains and stops everything; a missing server is one clear line, nothing started."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import httpx
import openai
import psutil
import pytest
import redis
from backends import missing
from pg_admin import PG_HOST, PG_USER, pg_admin, temporary_database
from redis_keys import delete_prefixed
from serving import MODEL, free_port, sse_events, wait_for

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def fairway_up(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fairway.cli", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("server", ["Redis", "PostgreSQL"])
def test_a_missing_server_is_one_line_and_nothing_starts(server):
    nowhere = {"Redis": "redis://127.0.0.1:1/0", "PostgreSQL": "postgresql://postgres@127.0.0.1:1/fairway"}[server]
    if server == "PostgreSQL":  # Redis answers, so the database is the one named
        try:
            redis.Redis.from_url(REDIS_URL).ping()
        except redis.ConnectionError as exc:
            missing("Redis", f"nothing answers at {REDIS_URL}: {exc}")
        args = ["--redis", REDIS_URL, "--database", nowhere]
    else:
        args = ["--redis", nowhere]
    proc = fairway_up(*args, "--port", str(free_port()))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert err.strip().count("\n") == 0 and f"no {server} answers at {nowhere}" in err, err


def test_up_serves_through_two_gateways_and_stops_on_ctrl_c(tmp_path):
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as exc:
        missing("Redis", f"nothing answers at {REDIS_URL}: {exc}")
    with temporary_database() as database:
        if database is None:
            missing("PostgreSQL", "no test server answers")
        namespace = f"test:{uuid.uuid4().hex[:12]}:"
        port = free_port()
        proc = fairway_up("--redis", REDIS_URL, "--database", database, "--port", str(port), "--namespace", namespace,
                          "--replica-arg=--max-model-len", "--replica-arg=1024")
        try:
            lines = []
            deadline = time.monotonic() + 240
            while not any(line.startswith("API key:") for line in lines):
                assert time.monotonic() < deadline and proc.poll() is None, (lines, proc.stderr.read())
                lines.append(proc.stdout.readline().strip())
            url = re.search(r"up at (\S+)", "\n".join(lines)).group(1)
            key = next(line for line in lines if line.startswith("API key:")).split(":", 1)[1].strip()
            assert url == f"http://127.0.0.1:{port}"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
            for _ in range(4):  # new connections: the kernel spreads them over both gateways
                reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                       messages=[{"role": "user", "content": "Say hi."}])
                assert reply.choices[0].finish_reason in ("stop", "length")
            # Both gateways listen on the one port (SO_REUSEPORT), each a process of its own.
            listening = {child.pid for child in psutil.Process(proc.pid).children(recursive=True)
                         for c in child.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
            assert len(listening) == 2, listening
            # Up is ready once a replica is live; the other may still be loading on a busy machine.
            registry = redis.Redis.from_url(REDIS_URL, decode_responses=True)
            wait_for(lambda: len(registry.smembers(f"{namespace}replicas")) == 2, timeout=120)
            registry.close()
            killed = kill_the_replica_mid_reply(proc, url, key)
            # Up started it again, under its own id, and stayed up; a new chat is served.
            wait_for(lambda: len(replica_pids(proc, killed)) == 1, timeout=30)
            reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Say hi."}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            began = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=90) == 0
            print(f"fairway up stopped in {time.monotonic() - began:.1f} s")
            assert f"the replica {killed} process exited (status -9); starting it again" in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            import asyncio

            asyncio.run(delete_prefixed(REDIS_URL, namespace))
    # Every child is gone with it.
    left = subprocess.run(["pgrep", "-f", f"--namespace {namespace}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def replica_pids(up: subprocess.Popen, replica_id: str) -> list[int]:
    """The live replica processes of this `fairway up` started under replica_id."""
    return [child.pid for child in psutil.Process(up.pid).children(recursive=True)
            if replica_id in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE]


def kill_the_replica_mid_reply(up: subprocess.Popen, url: str, key: str) -> str:
    """SIGKILL the replica writing a reply, mid-stream: the stream carries on to its end
    (failover, or the replica up starts again), every event once. Returns the killed replica's id.
    The reply was cut: its events after the kill paused for the takeover (a reply already whole in
    its log would have come at once)."""
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    tokens = 64  # 10 come before the kill: the rest wait for the takeover
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    ids, killed, arrived = [], "", []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for event in sse_events(r):
            if event.id is not None:
                ids.append(event.id)
                arrived.append(time.monotonic())
            if len(ids) == 10 and not killed:
                killed = http.get(f"/v1/replies/{r.headers['x-reply-id']}").json()["replica_id"]
                (pid,) = replica_pids(up, killed)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed and event.data == "[DONE]" and ids == list(range(1, len(ids) + 1)) and len(ids) == tokens + 1
    after = [killed_at, *(t for t in arrived if t > killed_at)]
    pause = max((b - a for a, b in zip(after, after[1:], strict=False)), default=0.0)
    assert pause > 0.3, f"no pause after the kill ({pause:.2f} s): the reply had ended before it"
    return killed


def test_a_process_that_keeps_exiting_after_up_stops_it_all(capsys):
    """Up starts a process that died again, but not one that cannot run here: after a few quick
    exits in a row it gives up (and `fairway up` stops everything, saying why)."""
    from fairway.up import MAX_QUICK_EXITS, Child, Deployment, UpOptions, fairway_process

    deployment = Deployment(UpOptions())
    deployment.children.append(Child("replica", ["--replica-id", "r-bad", "--no-such-flag"],
                                     fairway_process("replica", "--no-such-flag")))
    with pytest.raises(RuntimeError, match="the replica r-bad process keeps exiting") as gave_up:
        for _ in range(600):
            deployment.keep_alive()
            time.sleep(0.1)
    assert "status 2" in str(gave_up.value)
    assert capsys.readouterr().err.count("starting it again") == MAX_QUICK_EXITS


@pytest.mark.parametrize("flag", ["--replicas=0", "--gateways=0"])
def test_a_deployment_needs_a_process_of_each_kind(flag):
    proc = fairway_up(flag)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "at least 1" in err


def pg_or_skip() -> None:
    import asyncpg

    try:
        asyncio.run(pg_admin("SELECT 1"))
    except (OSError, asyncpg.PostgresError) as exc:
        missing("PostgreSQL", f"no test server answers at {PG_HOST}: {exc}")


def test_a_postgresql_login_refused_is_not_a_missing_server(capsys):
    """A role that does not exist was "no PostgreSQL answers ...; start one": the user went to
    start a server that was running, not to fix the URL."""
    from fairway.up import UpOptions, up

    pg_or_skip()
    database = f"postgresql://nosuchuser_{uuid.uuid4().hex[:8]}@{PG_HOST}/postgres"
    assert up(UpOptions(redis="", database=database)) == 2  # (before anything starts)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fairway up: PostgreSQL answers at {database} but refused the "
                                                   "login: role \"nosuchuser_"), err
    assert "(InvalidAuthorizationSpecificationError); fix the user or password in --database" in err


def test_a_missing_database_this_user_may_not_create_says_so():
    """CREATE DATABASE refused (no CREATEDB) was an InsufficientPrivilegeError traceback."""
    from fairway.up import ServerRefused, check_servers

    pg_or_skip()
    role = f"fairway_test_{uuid.uuid4().hex[:8]}"
    asyncio.run(pg_admin(f'CREATE ROLE "{role}" LOGIN'))  # (NOCREATEDB, the default)
    try:
        with pytest.raises(ServerRefused, match=r"has no database 'nosuchdb', and this user may not create it: "
                                                r"permission denied to create database; create it"):
            asyncio.run(check_servers(None, f"postgresql://{role}@{PG_HOST}/nosuchdb"))
    finally:
        asyncio.run(pg_admin(f'DROP ROLE "{role}"'))


def test_a_missing_database_is_created_under_its_own_name_not_the_urls_tail():
    """The name was the URL after its last "/": ?sslmode=disable made a database "x?sslmode=disable"."""
    from fairway.up import check_servers

    pg_or_skip()
    name = f"fairway_test_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(check_servers(None, f"postgresql://{PG_USER}@{PG_HOST}/{name}?sslmode=disable"))
        asyncio.run(pg_admin(f'DROP DATABASE "{name}"'))  # (fails unless it was made, and under its name)
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}?sslmode=disable"'))


def test_a_port_out_of_range_is_one_line_naming_the_url():
    """asyncio's socket raised OverflowError: a traceback."""
    from fairway.up import check_servers

    with pytest.raises(ValueError, match=r"^postgresql://u:\*\*\*@127.0.0.1:99999/x: Port out of range"):
        asyncio.run(check_servers(None, "postgresql://u:secret@127.0.0.1:99999/x"))


@pytest.fixture
def redis_with_password():
    """A Redis of its own that wants a password: its port."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "sesame",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: redis.Redis(port=port, password="sesame").ping(), timeout=10)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url,said", [
    ("redis://127.0.0.1:{port}/0", "(NOAUTH Authentication required.)"),
    ("redis://:wrong@127.0.0.1:{port}/0", "(WRONGPASS invalid username-password pair"),
    ("redis://:sesame@127.0.0.1:{port}/99", "(ERR DB index is out of range)"),
])
def test_a_redis_that_refuses_us_is_not_a_missing_redis(redis_with_password, url, said):
    """NOAUTH and WRONGPASS were "no Redis answers ...; start one (redis-server)"."""
    from fairway.up import ServerRefused, check_servers

    url = url.format(port=redis_with_password)
    with pytest.raises(ServerRefused) as refused:
        asyncio.run(check_servers(url, None))
    shown = re.sub(r":\w+@", ":***@", url)  # (a password is never printed)
    assert str(refused.value).startswith(f"Redis answers at {shown} but refused us {said}"), refused.value
    assert "fix the password or database number in --redis" in str(refused.value)
    asyncio.run(check_servers(f"redis://:sesame@127.0.0.1:{redis_with_password}/0", None))  # the right one passes
