"""Alembic environment for the conversation store.

Two ways in: SqlConversationStore.init() hands over an open connection (config.attributes
["connection"]) from inside its event loop; the alembic CLI (-c fairway/conversation/alembic.ini)
gets a URL from FAIRWAY_DB_URL and runs its own async engine.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from fairway.conversation.connect_params import engine_args
from fairway.conversation.schema import metadata

config = context.config


def _url() -> str:
    return os.environ.get("FAIRWAY_DB_URL") or config.get_main_option("sqlalchemy.url") or ""


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things in place: later revisions get batch mode there.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_own_engine() -> None:
    url, connect_args = engine_args(_url())  # (libpq's ?sslmode=... and the like, as the store reads them)
    engine = create_async_engine(url, connect_args=connect_args)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_configure)
    finally:
        await engine.dispose()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
    else:
        asyncio.run(_run_with_own_engine())


if context.is_offline_mode():
    run_offline()
else:
    run_online()
