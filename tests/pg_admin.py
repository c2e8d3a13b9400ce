"""Test helper: the PostgreSQL server the tests use, and admin statements on its maintenance database."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

PG_HOST = os.environ.get("FAIRWAY_TEST_PG_HOST", "127.0.0.1:5432")
PG_USER = os.environ.get("FAIRWAY_TEST_PG_USER", "postgres")


async def pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_USER}@{PG_HOST}/postgres", timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def terminate_lock_waiters(conn, query_like: str = "%", timeout_s: float = 20.0) -> None:
    """On conn's database, kill the backends waiting for a lock conn holds (a call blocked midway
    by a row the test holds) whose statement is like query_like; waits for one to appear (the call
    may come from another, busy process).

    conn is usually inside the transaction that holds the row, and PostgreSQL keeps a transaction's
    view of pg_stat_activity (each backend's state and statement) as it was at its first read: each
    poll clears it, or a call that arrives after the first poll is never seen with its statement."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        killed = await conn.fetchval("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                     "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                                     "AND pg_backend_pid() = ANY(pg_blocking_pids(pid)) "
                                     "AND query ILIKE $1", query_like)
        if killed:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no call waited for the lock within {timeout_s} s")


async def create_schema(url: str) -> str:
    """A new schema, named at random, in the database at url: a test's own rows, without the cost
    of a CREATE DATABASE."""
    import asyncpg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    return schema


@contextmanager
def temporary_database(prefix: str = "fairway_test_") -> Iterator[str | None]:
    """A fresh database on the test server for the block (its URL), dropped afterwards; None when
    no server answers."""
    import asyncpg

    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError):
        yield None
        return
    try:
        yield f"postgresql://{PG_USER}@{PG_HOST}/{name}"
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
