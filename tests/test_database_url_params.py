"""A PostgreSQL URL as libpq and every other tool write it, with query parameters (?sslmode=...,
?application_name=..., ?options=..., ?connect_timeout=...): SQLAlchemy handed them to asyncpg as
keyword arguments, a TypeError at the first connection (`fairway up`, creating its key)."""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

import asyncpg
import pytest
import sqlalchemy as sa
from backends import missing
from pg_admin import PG_HOST, PG_USER, create_schema, temporary_database

from fairway.cli import main
from fairway.conversation import StoreUnavailable, database_url, make_store
from fairway.conversation.connect_params import asyncpg_connect_args
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
                                       "PostgreSQL (it takes sslmode, sslrootcert, sslcert, sslkey, sslcrl, "
                                       "passfile, sslpassword, service, application_name, options, "
                                       "connect_timeout, target_session_attrs)\n")


async def test_a_password_file_reaches_the_connection(pg_database: str, tmp_path: Path) -> None:
    """?passfile=: libpq's password file (host:port:database:user:password), read by asyncpg for
    a URL without a password. The test server trusts every login, so the password it read is
    checked on the connection itself."""
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"{PG_HOST}:*:{PG_USER}:from-the-passfile\n")
    passfile.chmod(0o600)  # (a file others may read is ignored, as by libpq)
    url = f"{pg_database}?passfile={passfile}"
    conn = await asyncpg.connect(**asyncpg_connect_args(url))
    try:
        assert conn._params.password == "from-the-passfile"
    finally:
        await conn.close()
    store = make_store(url)
    try:
        await store.init()
        assert await store.get_conversation("conv_x", "u1") is None
    finally:
        await store.close()
    with pytest.raises(ValueError, match="passfile '/no/such/pgpass' is not a file here"):
        make_store(f"{pg_database}?passfile=/no/such/pgpass")


async def test_a_service_names_where_to_connect(pg_database: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """?service=: the server, database and user from the service file (PGSERVICEFILE); the URL
    names no host. A service the file lacks is refused at start: asyncpg would connect with its
    defaults instead."""
    where = urlsplit(pg_database)
    services = tmp_path / "pg_service.conf"
    services.write_text(f"[fairway-test]\nhost={where.hostname}\nport={where.port}\n"
                        f"dbname={where.path.lstrip('/')}\nuser={where.username}\n")
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    store = make_store("postgresql:///?service=fairway-test&application_name=fairway-service")
    try:
        await store.init()
        async with store._engine.connect() as conn:
            name = await conn.scalar(sa.select(sa.func.current_database()))
        assert name == where.path.lstrip("/")
        rows = await store._hot_path.fetch(SETTINGS, {})
        assert rows[0]["name"] == "fairway-service"
    finally:
        await store.close()
    with pytest.raises(ValueError, match=f"service 'other' is not in '{services}'"):
        make_store("postgresql:///?service=other")


def _client_tls_files(folder: Path, key_password: bytes) -> dict[str, Path]:
    """A CA, its (empty) CRL, and a client certificate whose key is encrypted with key_password."""
    pytest.importorskip("cryptography")  # (moto, of the test extra, brings it)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fairway test CA")])
    client_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PG_USER)])

    def certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + dt.timedelta(days=1)).sign(ca_key, hashes.SHA256()))

    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca_name).last_update(now)
           .next_update(now + dt.timedelta(days=1)).sign(ca_key, hashes.SHA256()))
    files = {"sslrootcert": folder / "root.crt", "sslcrl": folder / "root.crl", "sslcert": folder / "client.crt",
             "sslkey": folder / "client.key"}
    pem = serialization.Encoding.PEM
    files["sslrootcert"].write_bytes(certificate(ca_name, ca_key).public_bytes(pem))
    files["sslcrl"].write_bytes(crl.public_bytes(pem))
    files["sslcert"].write_bytes(certificate(client_name, client_key).public_bytes(pem))
    files["sslkey"].write_bytes(client_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(key_password)))
    return files


async def test_a_crl_and_a_key_password_go_into_the_ssl_context(pg_database: str, tmp_path: Path) -> None:
    """?sslcrl= and ?sslpassword= (a client key encrypted with it) are loaded into the SSL context
    asyncpg builds before it connects: with both right, the connection gets as far as the server
    (which, here, has no SSL); a wrong password or a CRL file that is none fails before that."""
    files = _client_tls_files(tmp_path, b"key-secret")
    other = tmp_path / "not-a.crl"
    other.write_text("not a CRL\n")

    async def connect(**params: str | Path) -> None:
        url = f"{pg_database}?sslmode=require&" + urlencode({k: str(v) for k, v in params.items()})
        conn = await asyncpg.connect(**asyncpg_connect_args(url), timeout=10)
        await conn.close()

    with pytest.raises(ConnectionError, match="rejected SSL upgrade"):  # the key and the CRL were loaded
        await connect(**files, sslpassword="key-secret")
    with pytest.raises(ssl.SSLError):
        await connect(**files, sslpassword="wrong")
    with pytest.raises(ssl.SSLError):
        await connect(**{**files, "sslcrl": other}, sslpassword="key-secret")
    store = make_store(f"{pg_database}?sslmode=require&" + urlencode({**{k: str(v) for k, v in files.items()},
                                                                      "sslpassword": "key-secret"}))
    try:
        with pytest.raises(StoreUnavailable, match="rejected SSL upgrade"):
            await store.init()
    finally:
        await store.close()
