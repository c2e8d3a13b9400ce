"""A PostgreSQL URL as libpq and every other tool write it, with query parameters (?sslmode=...,
?application_name=..., ?options=..., ?connect_timeout=...): SQLAlchemy handed them to asyncpg as
keyword arguments, a TypeError at the first connection (`fairway up`, creating its key)."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from backends import missing
from pg_admin import PG_HOST, create_schema, temporary_database

from fairway.cli import main
from fairway.conversation import StoreUnavailable, database_url, make_store
from fairway.conversation.hot_path import shared_hot_path
from fairway.retrieval.sql_index import make_engine

SETTINGS = sa.select(sa.func.current_setting("application_name").label("name"),
                     sa.func.current_setting("search_path").label("path"))


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    with temporary_database() as url:
        if url is None:
            missing("PostgreSQL", f"nothing answers at {PG_HOST}")
        yield url


async def test_a_store_connects_with_the_urls_libpq_parameters(pg_database: str) -> None:
    """sslmode, application_name, options (here the schema to use) and connect_timeout reach both
    of the store's ways to the server: the engine and the chat path's asyncpg pool."""
    schema = await create_schema(pg_database)
    options = quote(f"-c search_path={schema}")
    store = make_store(f"{pg_database}?sslmode=disable&application_name=fairway-test&options={options}"
                       "&connect_timeout=10")
    try:
        await store.init()
        assert await store.get_conversation("conv_x", "u1") is None  # the pool's, in the schema's tables
        assert await store.list_conversations("u1") == []  # the engine's
        async with store._engine.connect() as conn:
            assert tuple((await conn.execute(SETTINGS)).one()) == ("fairway-test", schema)
        rows = await store._hot_path.fetch(SETTINGS, {})
        assert (rows[0]["name"], rows[0]["path"]) == ("fairway-test", schema)
    finally:
        await store.close()


async def test_the_index_engine_and_its_pool_connect_with_them_too(pg_database: str) -> None:
    """Memory's, files' and the vector index's engine (retrieval/sql_index.make_engine), and the
    pool they share, beside a caller's own server settings."""
    engine = make_engine(database_url(f"{pg_database}?application_name=fairway-index&sslmode=prefer"),
                         {"server_settings": {"search_path": "public"}})
    hot = shared_hot_path(engine)
    try:
        async with engine.connect() as conn:
            assert tuple((await conn.execute(SETTINGS)).one()) == ("fairway-index", "public")
        assert tuple((await hot.fetch(SETTINGS, {}))[0]) == ("fairway-index", "public")
    finally:
        await hot.close()
        await engine.dispose()


async def test_sslmode_require_on_a_server_without_ssl_is_unavailable_not_a_type_error(pg_database: str) -> None:
    store = make_store(f"{pg_database}?sslmode=require")
    try:
        with pytest.raises(StoreUnavailable, match="rejected SSL upgrade"):
            await store.init()
        with pytest.raises(StoreUnavailable, match="rejected SSL upgrade"):
            await store.get_conversation("conv_x", "u1")
    finally:
        await store.close()


@pytest.mark.parametrize(("query", "said"), [
    ("sslmode=disable&sslcompression=1", "parameter 'sslcompression' is not supported on PostgreSQL (it takes sslmode"),
    ("sslmode=on", "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full, not 'on'"),
    ("connect_timeout=5s", "connect_timeout must be whole seconds, not '5s'"),
    ("sslmode=verify-full&sslrootcert=/no/such/root.crt", "sslrootcert '/no/such/root.crt' is not a file here"),
])
def test_a_parameter_asyncpg_cannot_take_is_refused_when_the_store_is_made(query: str, said: str) -> None:
    """At start, naming it (no server needed): it was a TypeError at the first connection."""
    for make in (make_store, lambda url: make_engine(database_url(url))):
        with pytest.raises(ValueError, match="^the database URL's " + said.replace("(", r"\(")):
            make(f"postgresql://u@127.0.0.1:1/x?{query}")


def test_the_cli_opens_a_url_with_libpq_parameters(pg_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`fairway keys list` (as serve, gateway and up: the server check, then the store)."""
    assert main(["keys", "list", "--database",
                 f"{pg_database}?sslmode=disable&application_name=fairway-cli&connect_timeout=10"]) == 0
    assert capsys.readouterr().out.startswith("id ")
    assert main(["keys", "list", "--database", f"{pg_database}?sslmode=require"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "answers at" in err and "but not over SSL as the URL asks" in err, err
    assert main(["keys", "list", "--database", f"{pg_database}?sslmode=disable&bogus=1"]) == 2
    assert capsys.readouterr().err == ("fairway: the database URL's parameter 'bogus' is not supported on "
                                       "PostgreSQL (it takes sslmode, sslrootcert, sslcert, sslkey, "
                                       "application_name, options, connect_timeout, target_session_attrs)\n")
