"""Test helper: the PostgreSQL server the tests use, and admin statements on its maintenance database."""

from __future__ import annotations

import os

PG_HOST = os.environ.get("FAIRWAY_TEST_PG_HOST", "127.0.0.1:5432")
PG_USER = os.environ.get("FAIRWAY_TEST_PG_USER", "postgres")


async def pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_USER}@{PG_HOST}/postgres", timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
