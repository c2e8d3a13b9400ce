"""The chat path's single statements on PostgreSQL, run on asyncpg's own pool.

Through SQLAlchemy's async engine each statement also pays for the pool's checkout events, the
autocommit switch and its reset, a greenlet hop and an execution context, and a chat request
runs six or more (its turn, the replica's start, both saves of the reply, its job for accounting,
its usage record; a later turn also reads its conversation and history): bench/store_requests.py
measures the difference. The statements stay SQLAlchemy's, built once in sql_store.py: each is
compiled once for PostgreSQL ($n parameters, typed) and run through asyncpg's per-connection
prepared-statement cache. Transactions of several statements, migrations and rare reads stay on
the engine.

Every statement runs alone on an autocommit connection, as on the engine's autocommit path, so
a connection goes back to the pool without asyncpg's reset query (a round trip that would undo
nothing). A constraint violation surfaces as SQLAlchemy's IntegrityError (the store's callers
handle that); other errors as asyncpg raises them (sql_store.py tells the unreachable server
apart). The pool replaces a connection the server closed, at checkout.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import asyncpg
import orjson
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.dml import Insert

_Compiled = tuple[str, tuple[str, ...], dict[str, Any]]

# The connection a task holds for a run of statements (one_connection), with its pool and task: a
# task it spawns inherits the variable but must not share the connection (asyncpg runs one
# operation at a time on it).
_HELD: contextvars.ContextVar[tuple[asyncpg.Pool, asyncio.Task[Any] | None, asyncpg.Connection] | None] = \
    contextvars.ContextVar("fairway_pg_held", default=None)


def _held_from(pool: asyncpg.Pool) -> asyncpg.Connection | None:
    """The connection of pool this task holds inside one_connection(), if it is inside one."""
    held = _HELD.get()
    return held[2] if held is not None and held[0] is pool and held[1] is asyncio.current_task() else None


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


async def _setup(conn: asyncpg.Connection) -> None:
    # JSON and JSONB columns (a reply's job and prompt ids) as Python values both ways, as the
    # engine hands them.
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, encoder=_dumps, decoder=orjson.loads, schema="pg_catalog")


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """The pool's reset: nothing to undo. asyncpg still rolls back an open transaction first (a
    statement cancelled midway leaves none: each runs in its own implicit one)."""


class PostgresHotPath:
    """asyncpg's pool on the store's database, and the statements compiled for it."""

    @classmethod
    def of_engine(cls, engine: AsyncEngine, connect_args: Mapping[str, Any] | None = None,
                  size: int = 16) -> PostgresHotPath:
        """A pool on the database of this (PostgreSQL) engine, connecting as the engine does."""
        _, url_kwargs = engine.dialect.create_connect_args(engine.url)
        return cls({**url_kwargs, **(connect_args or {})}, engine.dialect, size)

    def __init__(self, connect_kwargs: Mapping[str, Any], dialect: Dialect, size: int = 16) -> None:
        self._connect_kwargs = dict(connect_kwargs)  # asyncpg.connect's: what the engine would use
        self._dialect = dialect
        self._size = size
        self._pool: asyncpg.Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Keyed by the statement object (prebuilt, so it lives as long as the process) and, for a
        # bare INSERT, the columns given.
        self._compiled: dict[tuple[ClauseElement, frozenset[str] | None], _Compiled] = {}

    async def fetch(self, statement: ClauseElement, params: Mapping[str, Any]) -> Sequence[asyncpg.Record]:
        """Run one statement with these named parameters; its rows (none for a plain INSERT)."""
        return await self._run(statement, [params], many=False)

    async def fetch_many(self, statement: ClauseElement,
                         params_list: Sequence[Mapping[str, Any]]) -> Sequence[asyncpg.Record]:
        """Run one statement once per set of named parameters (same names in each), pipelined in
        one round trip (asyncpg's fetchmany, one transaction); the rows of all, in order."""
        if not params_list:
            return []
        return await self._run(statement, params_list, many=True)

    async def _run(self, statement: ClauseElement, params_list: Sequence[Mapping[str, Any]],
                   many: bool) -> Sequence[asyncpg.Record]:
        sql, names, fixed = self._compile(statement, params_list[0])
        args = [[params[name] if name in params else fixed[name] for name in names] for params in params_list]
        pool = self._this_loops_pool() or await self._open(asyncio.get_running_loop())
        try:
            if (held := _held_from(pool)) is not None:
                return await (held.fetchmany(sql, args) if many else held.fetch(sql, *args[0]))
            async with pool.acquire() as conn:
                return await (conn.fetchmany(sql, args) if many else conn.fetch(sql, *args[0]))
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityError(sql, args, exc) from exc

    @contextlib.asynccontextmanager
    async def one_connection(self) -> AsyncIterator[None]:
        """The statements this task runs inside take one connection from the pool between them,
        not one each: a checkout and its release cost the process nearly as much CPU as a short
        statement (bench/README.md, pg_statement.py). Each still runs alone (autocommit), as outside."""
        pool = self._this_loops_pool() or await self._open(asyncio.get_running_loop())
        if _held_from(pool) is not None:
            yield  # (inside another: that one's)
            return
        async with pool.acquire() as conn:
            token = _HELD.set((pool, asyncio.current_task(), conn))
            try:
                yield
            finally:
                _HELD.reset(token)

    def _this_loops_pool(self) -> asyncpg.Pool | None:
        """The pool, if one is open on the running loop (else _open makes one)."""
        return self._pool if self._loop is asyncio.get_running_loop() else None

    async def _open(self, loop: asyncio.AbstractEventLoop) -> asyncpg.Pool:
        # Connections belong to the loop that opened them: a store used from another loop (a test
        # client's, a CLI command's) gets a pool of its own there.
        self._discard()
        # min_size=0 opens nothing yet (a connection at its first checkout), so creating the pool
        # does no I/O and cannot fail for an unreachable server. No idle timeout, as the engine's.
        pool = await asyncpg.create_pool(**self._connect_kwargs, min_size=0, max_size=self._size, init=_setup,
                                         reset=_keep_session, max_inactive_connection_lifetime=0)
        if self._pool is not None and self._loop is loop:  # another task opened one meanwhile
            pool.terminate()
            return self._pool
        self._pool, self._loop = pool, loop
        return pool

    def _discard(self) -> None:
        pool, self._pool, self._loop = self._pool, None, None
        if pool is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed already: its sockets go with it
                pool.terminate()

    async def close(self) -> None:
        pool = self._pool
        if pool is None or self._loop is not asyncio.get_running_loop():
            self._discard()
            return
        self._pool = self._loop = None
        try:
            await asyncio.wait_for(pool.close(), 5)  # what is in flight finishes first
        except TimeoutError:
            pool.terminate()

    def _compile(self, statement: ClauseElement, params: Mapping[str, Any]) -> _Compiled:
        """SQL with $n parameters, the names in their order, and the values the statement carries
        itself (literals in it), compiled once per statement."""
        columns = frozenset(params) if isinstance(statement, Insert) else None
        key = (statement, columns)
        compiled = self._compiled.get(key)
        if compiled is None:
            done = statement.compile(dialect=self._dialect, column_keys=sorted(columns) if columns else None)
            fixed = {name: bind.effective_value for name, bind in done.binds.items() if not bind.required}
            compiled = self._compiled[key] = (done.string, tuple(done.positiontup or ()), fixed)
        return compiled


_shared: weakref.WeakKeyDictionary[AsyncEngine, PostgresHotPath] = weakref.WeakKeyDictionary()


def shared_hot_path(engine: AsyncEngine, connect_args: Mapping[str, Any] | None = None) -> PostgresHotPath | None:
    """One hot path per engine for the parts that share it (memory's and files' tables beside
    the vector index), so they hold one small pool between them; None off PostgreSQL. The first
    call names the engine's connect_args (its creator's: a test's search_path, say)."""
    if engine.dialect.name != "postgresql":
        return None
    if engine not in _shared:
        _shared[engine] = PostgresHotPath.of_engine(engine, connect_args, size=8)
    return _shared[engine]
