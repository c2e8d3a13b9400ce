"""`fairway up`: a deployment on this machine with one command. It starts `--replicas` replica
processes (each the engine and its worker) and `--gateways` gateway processes (each the whole
HTTP API, stateless) on one Redis and one PostgreSQL database, the gateways sharing one port (the
kernel spreads connections over them: SO_REUSEPORT), prints the URL and an API key, and on
Ctrl-C (or SIGTERM) drains the replicas, stops the gateways and waits for all of them.

Once up, it keeps them up: a process that dies (killed, out of memory) is started again with the
same arguments, a replica under its own --replica-id, while the others serve (the replies it was
writing carry on elsewhere: failover). One that keeps dying soon after its start stops it all.

Before starting anything it checks both servers and says in one line which one is missing, or
which one answered but refused us (a role, a password, a database number: the URL to fix), in the
server's own words. The database is created if the server has no database of that name yet.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/fairway"


@dataclass
class UpOptions:
    replicas: int = 2
    gateways: int = 2
    redis: str = DEFAULT_REDIS
    database: str = DEFAULT_DATABASE
    host: str = "127.0.0.1"
    port: int = 8000
    namespace: str = "fairway:"
    replica_args: list[str] = field(default_factory=list)  # passed on to every `fairway replica`
    gateway_args: list[str] = field(default_factory=list)  # and to every `fairway gateway`


class ServerUnusable(RuntimeError):
    """A server `fairway up` needs cannot be used (the message names it, the URL and why)."""


class ServerMissing(ServerUnusable):
    """Nothing answers at the URL: the server is down, or the host or port is wrong."""


class ServerRefused(ServerUnusable):
    """The server answered but refused us (a login, a password, a database): the URL is what to
    fix, not the server's absence, so the message says so with the server's own words."""


async def check_servers(redis_url: str | None, database_url: str | None) -> None:
    """Raise ServerMissing or ServerRefused for the first server that cannot be used (None: not
    used); create the database when only it is missing. `up` and the commands that need a server
    check first with it, so a missing one is one line, not a traceback."""
    if redis_url:
        await _check_redis(redis_url)
    if database_url:
        await _ensure_database(database_url.replace("+asyncpg://", "://", 1))


async def _check_redis(url: str) -> None:
    from fairway.redis_client import RedisClient

    client = RedisClient(url)
    try:
        await asyncio.wait_for(client.ping(), 5)
    except Exception as exc:  # refused, timed out, an error reply, or redis-py's own connection errors
        if _redis_refused(exc):
            said = str(exc).removeprefix("Redis refused the connection setup: ")  # (Redis's own words)
            raise ServerRefused(f"Redis answers at {shown_url(url)} but refused us ({said}); fix the password or "
                                "database number in --redis (redis://[[user]:password@]host:port/db)") from None
        raise ServerMissing(f"no Redis answers at {shown_url(url)} ({_reason(exc)}); "
                            "start one (redis-server) or pass --redis") from None
    finally:
        await client.close()


def _redis_refused(exc: Exception) -> bool:
    """Whether Redis itself answered with an error: NOAUTH to our PING (a password is needed), or
    an error to the connection's setup (AUTH's WRONGPASS, SELECT's "DB index is out of range"),
    which the client raises as a ConnectionError of its own wording (fairway/redis_client/mux.py)."""
    from redis.exceptions import ResponseError

    return isinstance(exc, ResponseError) or "refused the connection setup" in str(exc)


async def _ensure_database(url: str) -> None:
    import asyncpg

    from fairway.conversation.connect_params import asyncpg_connect_args

    _port_in_range(url)
    args = {"timeout": 5, **asyncpg_connect_args(url)}  # as the store connects (?sslmode=... and the like)
    try:
        conn = await asyncpg.connect(**args)
    except asyncpg.InvalidCatalogNameError as exc:
        await _create_database(url, args, exc)
        return
    except asyncpg.ClientConfigurationError as exc:  # verify-full without a root certificate, say
        raise ValueError(f"{shown_url(url)}: {' '.join(str(exc).split())}") from None
    except asyncpg.PostgresError as exc:  # it answered: the role, the password, or the server said no
        login = isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError)  # (InvalidPasswordError too)
        raise ServerRefused(f"PostgreSQL answers at {shown_url(url)} but refused the "
                            f"{'login' if login else 'connection'}: {exc} ({exc.__class__.__name__})"
                            + ("; fix the user or password in --database" if login else "")) from None
    except (OSError, TimeoutError) as exc:
        if _ssl_failed(exc):
            raise ServerRefused(f"PostgreSQL answers at {shown_url(url)} but not over SSL as the URL asks "
                                f"({_reason(exc)}); fix sslmode or sslrootcert in --database") from None
        raise ServerMissing(f"no PostgreSQL answers at {shown_url(url)} ({_reason(exc)}); "
                            "start one or pass --database") from None
    await conn.close()


def _ssl_failed(exc: BaseException) -> bool:
    """Whether the server answered but the SSL the URL's sslmode asks for failed: it has none
    (asyncpg's plain ConnectionError says so), or its certificate did not verify."""
    return isinstance(exc, ssl.SSLError) or "rejected SSL upgrade" in str(exc)


async def _create_database(url: str, args: dict[str, Any], missing: Exception) -> None:
    """Create the database url names (args: asyncpg's connect arguments for it), through the
    server's `postgres` database; ServerRefused when this user cannot (no CREATEDB privilege, no
    `postgres` database it may enter)."""
    import asyncpg

    name = args.get("database")  # (the URL's path alone: a ?sslmode=... is not part of the name)
    shown = shown_url(url)
    if not name:  # asyncpg took the user's name as the database's
        raise ServerRefused(f"PostgreSQL answers at {shown} but {missing}; name the database in --database")
    try:
        admin = await asyncpg.connect(**{**args, "database": "postgres"})
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise ServerRefused(f"PostgreSQL at {shown} has no database {name!r}, and its 'postgres' database, "
                            f"where it would be created, refused us: {exc}; create it (createdb) or fix --database"
                            ) from None
    try:
        await admin.execute(f'CREATE DATABASE "{name.replace(chr(34), chr(34) * 2)}"')
    except asyncpg.DuplicateDatabaseError:
        pass  # another `fairway up` made it meanwhile
    except asyncpg.PostgresError as exc:
        raise ServerRefused(f"PostgreSQL at {shown} has no database {name!r}, and this user may not create it: "
                            f"{exc}; create it (createdb) or fix --database") from None
    finally:
        await admin.close()


def _port_in_range(url: str) -> None:
    """A ValueError naming the URL for a port above 65535: the socket's OverflowError was a traceback."""
    try:
        _ = urlsplit(url).port  # (the property parses, and checks, the port)
    except ValueError as exc:
        raise ValueError(f"{shown_url(url)}: {exc}") from None


def shown_url(url: str) -> str:
    """url without its password, for messages a user may paste into an issue."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}"))


def _reason(exc: BaseException) -> str:
    """The exception's class and message; a TimeoutError's message is empty."""
    return f"{exc.__class__.__name__}: {exc}" if str(exc) else f"{exc.__class__.__name__}: no answer in 5 s"


async def make_key(database_url: str) -> str:
    """A new paid-tier key for the local user, stored in the deployment's database."""
    from fairway.conversation import make_store
    from fairway.gateway.keys import create_key

    store = make_store(database_url)
    await store.init()
    try:
        _, key = await create_key(store, "local", "paid", "fairway up")
        return key
    finally:
        await store.close()


RESTART_WINDOW_S = 60.0  # exits this soon after a start count towards giving up
MAX_QUICK_EXITS = 3  # that many in a row: it cannot run here (a bad argument, a port taken)


@dataclass
class Child:
    """One process of the deployment and how to start it again."""

    kind: str  # "replica" or "gateway"
    args: list[str]  # `fairway KIND ARGS`
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    quick_exits: int = 0  # exits in a row, each within RESTART_WINDOW_S of its start

    @property
    def name(self) -> str:
        if "--replica-id" in self.args:
            return f"{self.kind} {self.args[self.args.index('--replica-id') + 1]}"
        return f"{self.kind} (pid {self.proc.pid})"


class Deployment:
    """The processes of one `fairway up`."""

    def __init__(self, options: UpOptions) -> None:
        self.options = options
        self.children: list[Child] = []

    @property
    def replicas(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children if c.kind == "replica"]

    @property
    def gateways(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children if c.kind == "gateway"]

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def start(self) -> None:
        o = self.options
        shared = ["--redis", o.redis, "--namespace", o.namespace]
        run = uuid.uuid4().hex[:6]
        for i in range(o.replicas):
            self._spawn("replica", [*shared, "--replica-id", f"local-{run}-{i}", *o.replica_args])
        for _ in range(o.gateways):
            self._spawn("gateway", [*shared, "--database", o.database, "--host", o.host, "--port", str(o.port),
                                    "--reuse-port", *o.gateway_args])

    def _spawn(self, kind: str, args: list[str]) -> None:
        self.children.append(Child(kind, args, fairway_process(kind, *args)))

    def wait_ready(self, stopped: Callable[[], bool], timeout_s: float = 300.0) -> bool:
        """Until the port answers /ready (a gateway is up and some replica is live); False if
        stopped() meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stopped():
                return False
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} was not ready after {timeout_s:.0f} s")

    def check_alive(self) -> None:
        """Before the deployment is up: any process that exits is a reason to stop (it could not start)."""
        for child in self.children:
            if child.proc.poll() is not None:
                raise RuntimeError(f"a {child.kind} process exited (status {child.proc.returncode})")

    def keep_alive(self) -> None:
        """Once up: start each process that exited again; RuntimeError for one that keeps exiting
        soon after its start."""
        for child in self.children:
            if child.proc.poll() is None:
                continue
            quick = time.monotonic() - child.started_at < RESTART_WINDOW_S
            child.quick_exits = child.quick_exits + 1 if quick else 1
            if child.quick_exits > MAX_QUICK_EXITS:
                raise RuntimeError(f"the {child.name} process keeps exiting (status {child.proc.returncode}, "
                                   f"{MAX_QUICK_EXITS} restarts within {RESTART_WINDOW_S:.0f} s of each start)")
            print(f"fairway up: the {child.name} process exited (status {child.proc.returncode}); starting it again",
                  file=sys.stderr, flush=True)
            child.proc, child.started_at = fairway_process(child.kind, *child.args), time.monotonic()

    def stop(self, grace_s: float = 45.0) -> None:
        """Drain the replicas (SIGTERM), stop the gateways once the replicas are done (they
        carry the streams of replies handed on meanwhile), and wait for every process."""
        for proc in self.replicas:
            send_signal(proc, signal.SIGTERM)
        wait_all(self.replicas, grace_s)
        for proc in self.gateways:
            send_signal(proc, signal.SIGTERM)
        wait_all(self.gateways, 15.0)


def fairway_process(command: str, *args: str, log: IO[bytes] | None = None,
                    env: dict[str, str] | None = None) -> subprocess.Popen:
    """`fairway COMMAND ARGS` as a child process, its output to log (default: ours), with env
    over our environment."""
    # Children ignore the terminal's Ctrl-C (their own process group): `up` stops them in order.
    return subprocess.Popen([sys.executable, "-m", "fairway.cli", command, *args], start_new_session=True,
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT if log else None)


def send_signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def up(options: UpOptions) -> int:
    try:
        asyncio.run(check_servers(options.redis, options.database))
    except ServerUnusable as exc:
        print(f"fairway up: {exc}", file=sys.stderr)
        return 2
    key = asyncio.run(make_key(options.database))
    deployment = Deployment(options)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deployment.start()
        if not deployment.wait_ready(lambda: bool(stopping)):
            return 0
        print(f"Fairway is up at {deployment.url} ({_count(options.gateways, 'gateway')}, "
              f"{_count(options.replicas, 'replica')})",
              flush=True)
        print(f"API key: {key}", flush=True)
        print("Ctrl-C drains the replicas and stops everything.", flush=True)
        while not stopping:
            deployment.keep_alive()
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"fairway up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("fairway up: stopping (replicas drain first)", file=sys.stderr, flush=True)
        deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
