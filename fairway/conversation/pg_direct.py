"""The chat path's single statements on PostgreSQL, run on asyncpg directly.

Through SQLAlchemy's async engine one prebuilt statement costs a gateway ~220-310 us of CPU here
(pool checkout and its events, the autocommit switch and its reset, the greenlet hop, the
execution context, result rows); the same statement on an asyncpg connection taken from a plain
free list costs ~35-50 us, and a chat request runs six or more (its turn, the replica's start,
both saves of the reply, its job for accounting, its usage record; a later turn also reads its
conversation and history). The statements stay SQLAlchemy's, built once in sql_store.py: each is
compiled once for PostgreSQL ($n parameters, typed) and run through asyncpg's own per-connection
prepared-statement cache. Transactions of several statements, migrations and rare reads stay on
the engine.

Every statement runs alone on an autocommit connection, as on the engine's autocommit path. A
constraint violation surfaces as SQLAlchemy's IntegrityError (the store's callers handle that);
other errors as asyncpg raises them. A connection that failed other than by the server refusing
the statement (a lost socket, a cancelled call) is closed, not reused; one the server closed
while idle is dropped at checkout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.dml import Insert

_Compiled = tuple[str, tuple[str, ...], dict[str, Any]]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


async def _setup(conn: asyncpg.Connection) -> None:
    # JSON and JSONB columns (a reply's job and prompt ids) as Python values both ways, as the
    # engine hands them.
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, encoder=_dumps, decoder=json.loads, schema="pg_catalog")


class DirectPostgres:
    """A bounded free list of asyncpg connections and the statements compiled for them."""

    def __init__(self, connect_kwargs: Mapping[str, Any], dialect: Dialect, size: int = 16) -> None:
        self._connect_kwargs = dict(connect_kwargs)  # asyncpg.connect's: what the engine would use
        self._dialect = dialect
        self._size = size
        self._idle: list[asyncpg.Connection] = []
        self._slots: asyncio.Semaphore | None = None
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
        conn = await self._acquire()
        slots = self._slots  # (the one acquired: a store used from another loop meanwhile gets new ones)
        reusable = False
        try:
            rows = await (conn.fetchmany(sql, args) if many else conn.fetch(sql, *args[0]))
            reusable = True
            return rows
        except asyncpg.IntegrityConstraintViolationError as exc:
            reusable = True
            raise IntegrityError(sql, args, exc) from exc
        except asyncpg.PostgresError:
            reusable = True  # refused by the server: the connection is fine
            raise
        finally:
            self._release(conn, reusable, slots)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(conn.close(timeout=5) for conn in idle), return_exceptions=True)

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

    async def _acquire(self) -> asyncpg.Connection:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            for conn in self._idle:
                conn.terminate()
            self._idle, self._loop, self._slots = [], loop, asyncio.Semaphore(self._size)
        assert self._slots is not None
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():  # (a PostgreSQL restart, an idle timeout)
                    return conn
            conn = await asyncpg.connect(**self._connect_kwargs)
            try:
                await _setup(conn)
            except BaseException:
                conn.terminate()
                raise
            return conn
        except BaseException:
            self._slots.release()
            raise

    def _release(self, conn: asyncpg.Connection, reusable: bool, slots: asyncio.Semaphore | None) -> None:
        if reusable and not conn.is_closed() and slots is self._slots:
            self._idle.append(conn)
        else:
            conn.terminate()
        if slots is not None:
            slots.release()
