"""The vector index on SQL: SQLite (the embedded default, in the conversation store's database
file) and PostgreSQL, with pgvector's HNSW index (cosine) when the server has the extension,
else the same exact search as SQLite.

Exact search reads a partition's vectors once per change (vector_partitions.version, bumped by
every write in its transaction) into a per-process numpy matrix (exact.PartitionCache); a lookup
then costs one indexed SELECT of the version, a matrix product and one SELECT of the k rows.
SQLite cannot load extensions in this interpreter, so there is no sqlite-vec path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fairway.conversation.connect_params import engine_args
from fairway.conversation.hot_path import shared_hot_path
from fairway.conversation.sql_store import migrate, reaching_database, store_errors_on_engine

from .exact import PartitionCache, PartitionMatrix, top_k
from .index import Entry, Hit, Stored, VectorIndex, as_unit_vector

log = logging.getLogger(__name__)

DEFAULT_DIM = 384  # all-MiniLM-L6-v2
Json = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


class PgVector(sa.types.UserDefinedType):
    """pgvector's vector(dim), sent as its text form ('[0.1,0.2,...]') cast on the server, so
    asyncpg needs no codec for it. Never read back: search computes the distance in SQL."""

    cache_ok = True

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def get_col_spec(self, **_: Any) -> str:
        return f"vector({self.dim})"

    def bind_processor(self, dialect: Any):  # noqa: ANN201 - SQLAlchemy's signature
        return lambda v: None if v is None else "[" + ",".join(f"{x:.7g}" for x in v) + "]"

    def bind_expression(self, bindvalue: Any) -> Any:
        return sa.cast(sa.cast(bindvalue, sa.Text), self)


_PGVECTOR_SETTINGS = sa.text(
    "SELECT set_config('hnsw.iterative_scan', 'strict_order', true), set_config('hnsw.ef_search', :ef_search, true), "
    "set_config('plan_cache_mode', 'force_custom_plan', true)")


def _tables(dim: int, pgvector: bool) -> tuple[sa.MetaData, sa.Table, sa.Table]:
    metadata = sa.MetaData()
    vectors = sa.Table(
        "vectors", metadata,
        sa.Column("collection", sa.String(32), nullable=False),
        sa.Column("partition", sa.String(128), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("meta", Json, nullable=False),
        sa.Column("embedding", PgVector(dim) if pgvector else sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("collection", "partition", "key", name="pk_vectors"),
    )
    partitions = sa.Table(
        "vector_partitions", metadata,
        sa.Column("collection", sa.String(32), nullable=False),
        sa.Column("partition", sa.String(128), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("collection", "partition", name="pk_vector_partitions"),
    )
    return metadata, vectors, partitions


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # the conversation store's file: same settings
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_engine(url: str, connect_args: dict[str, Any] | None = None) -> AsyncEngine:
    """An async engine for an async SQLAlchemy URL (fairway.conversation.database_url's; libpq's
    parameters in a PostgreSQL URL's query become asyncpg's connect_args, as for the store)."""
    url, connect_args = engine_args(url, connect_args)
    parsed = make_url(url)
    connect = {"connect_args": connect_args} if connect_args else {}
    if parsed.get_backend_name() != "sqlite":
        engine = create_async_engine(url, pool_size=10, max_overflow=10, **connect)
        store_errors_on_engine(engine)  # a NUL in a memory or a file's text: a 400; the server away: a 503
        shared_hot_path(engine, connect_args)  # the parts on this engine share it, connecting alike
        return engine
    options: dict[str, Any] = {"poolclass": StaticPool} if parsed.database in (None, "", ":memory:") else {}
    engine = create_async_engine(url, **options, **connect)
    sa.event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


class SqlTables:
    """Tables of their own in the conversation store's database (memory's, files'), on an engine
    of their own or one shared with another part. The store's migrations make them (init runs
    them to head); `metadata` is what the queries are written against."""

    metadata: sa.MetaData

    def __init__(self, url: str | AsyncEngine, connect_args: dict[str, Any] | None = None) -> None:
        self.engine = url if isinstance(url, AsyncEngine) else make_engine(url, connect_args)
        self.postgres = self.engine.dialect.name == "postgresql"
        # A chat turn's statements (memory's block, the attached files) skip the engine's
        # per-statement overhead on PostgreSQL, as the conversation store's do.
        self.hot = shared_hot_path(self.engine)

    async def init(self) -> None:
        await migrate(self.engine)

    async def close(self) -> None:
        if self.hot is not None:
            await self.hot.close()
        await self.engine.dispose()

    async def rows_many(self, statement: sa.Executable, params_list: Sequence[Mapping[str, Any]]) -> None:
        """One prebuilt statement per set of parameters (the same names in each), in one round
        trip (PostgreSQL: pipelined in one transaction) or one transaction (SQLite)."""
        if not params_list:
            return
        if self.hot is not None:
            with reaching_database():
                await self.hot.fetch_many(statement, params_list)
            return
        async with self.engine.begin() as conn:
            for params in params_list:
                await conn.execute(statement, params)

    async def rows(self, statement: sa.Executable, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        """One prebuilt statement (its values as bind parameters), alone: its rows. A write
        commits by itself."""
        if self.hot is not None:
            with reaching_database():
                return await self.hot.fetch(statement, params)
        async with self.engine.begin() as conn:
            result = await conn.execute(statement, params)
            return result.mappings().all() if result.returns_rows else []

    def insert(self, table: sa.Table) -> Any:
        """INSERT for this dialect, with on_conflict_do_update / _do_nothing."""
        return (postgresql if self.postgres else sqlite).insert(table)


class SqlVectorIndex(VectorIndex):
    def __init__(self, url: str, dim: int = DEFAULT_DIM, require_pgvector: bool = False,
                 cache_bytes: int = 256 << 20, connect_args: dict[str, Any] | None = None) -> None:
        self.url = url
        self.dim = dim
        self.engine = make_engine(url, connect_args)
        self.postgres = self.engine.dialect.name == "postgresql"
        self._require_pgvector = require_pgvector  # else pgvector whenever the table has its type
        self.kind = "exact"
        self._metadata, self.vectors, self.partitions = _tables(dim, False)
        self._cache = PartitionCache(cache_bytes)

    # -- schema ------------------------------------------------------------------------------

    async def init(self) -> None:
        """The store's migrations make the table (pgvector's type where the server has it); its
        column's type says which search this is."""
        await migrate(self.engine)
        async with self.engine.connect() as conn:
            pgvector = self.postgres and await self._pgvector(conn)
        if self._require_pgvector and not pgvector:
            raise RuntimeError("pgvector was asked for but the vectors table does not use it (the server "
                               "lacked the extension when the table was made)")
        self.kind = "pgvector" if pgvector else "exact"
        self._metadata, self.vectors, self.partitions = _tables(self.dim, pgvector)
        log.info("vector index on %s: %s search", self.engine.dialect.name, self.kind)

    @staticmethod
    async def _pgvector(conn: AsyncConnection) -> bool:
        """Whether the vectors table stores pgvector's type."""
        existing = (await conn.execute(sa.text(
            "SELECT udt_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'vectors' AND column_name = 'embedding'"))).scalar()
        return existing == "vector"

    async def close(self) -> None:
        hot = shared_hot_path(self.engine)  # the pool memory's and files' tables share with it
        if hot is not None:
            await hot.close()
        await self.engine.dispose()

    # -- writes ------------------------------------------------------------------------------

    def _insert(self, table: sa.Table) -> Any:
        return (postgresql if self.postgres else sqlite).insert(table)

    async def _bump(self, conn: AsyncConnection, collection: str, partition: str) -> None:
        stmt = self._insert(self.partitions).values(collection=collection, partition=partition, version=1)
        stmt = stmt.on_conflict_do_update(index_elements=["collection", "partition"],
                                          set_={"version": self.partitions.c.version + 1})
        await conn.execute(stmt)

    def _embedding(self, vector: np.ndarray) -> Any:
        v = as_unit_vector(vector, self.dim)
        return v.tolist() if self.kind == "pgvector" else v.tobytes()

    async def upsert(self, collection: str, partition: str, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        rows = [{"collection": collection, "partition": partition, "key": e.key, "text": e.text,
                 "meta": e.meta, "embedding": self._embedding(e.vector)} for e in entries]
        stmt = self._insert(self.vectors)
        stmt = stmt.on_conflict_do_update(
            index_elements=["collection", "partition", "key"],
            set_={c: stmt.excluded[c] for c in ("text", "meta", "embedding")})
        async with self.engine.begin() as conn:
            for start in range(0, len(rows), 500):
                await conn.execute(stmt, rows[start : start + 500])
            await self._bump(conn, collection, partition)

    def _in_partition(self, collection: str, partition: str) -> sa.ColumnElement[bool]:
        return sa.and_(self.vectors.c.collection == collection, self.vectors.c.partition == partition)

    async def delete(self, collection: str, partition: str, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        async with self.engine.begin() as conn:
            result = await conn.execute(sa.delete(self.vectors).where(
                self._in_partition(collection, partition), self.vectors.c.key.in_(list(keys))))
            await self._bump(conn, collection, partition)
        return result.rowcount

    async def delete_partition(self, collection: str, partition: str) -> int:
        async with self.engine.begin() as conn:
            result = await conn.execute(sa.delete(self.vectors).where(self._in_partition(collection, partition)))
            await self._bump(conn, collection, partition)
        self._cache.drop(collection, partition)
        return result.rowcount

    async def copy_partition(self, collection: str, partition: str, to_collection: str, to_partition: str) -> int:
        v = self.vectors.c
        source = sa.select(sa.literal(to_collection), sa.literal(to_partition), v.key, v.text, v.meta,
                           v.embedding).where(self._in_partition(collection, partition))
        stmt = self._insert(self.vectors).from_select(["collection", "partition", "key", "text", "meta",
                                                        "embedding"], source)
        stmt = stmt.on_conflict_do_update(index_elements=["collection", "partition", "key"],
                                          set_={c: stmt.excluded[c] for c in ("text", "meta", "embedding")})
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt)
            await self._bump(conn, to_collection, to_partition)
        return result.rowcount

    # -- reads -------------------------------------------------------------------------------

    async def get(self, collection: str, partition: str, keys: Sequence[str]) -> list[Stored]:
        if not keys:
            return []
        v = self.vectors.c
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(v.key, v.text, v.meta).where(
                self._in_partition(collection, partition), v.key.in_(list(keys))))).all()
        found = {r.key: Stored(r.key, r.text, r.meta) for r in rows}
        return [found[k] for k in keys if k in found]

    async def count(self, collection: str, partition: str) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(self.vectors)
                                           .where(self._in_partition(collection, partition)))).scalar_one())

    async def search(self, collection: str, partition: str, vector: np.ndarray, k: int,
                     min_score: float = -1.0) -> list[Hit]:
        q = as_unit_vector(vector, self.dim)
        if k <= 0:
            return []
        if self.kind == "pgvector":
            return await self._search_pgvector(collection, partition, q, k, min_score)
        return await self._search_exact(collection, partition, q, k, min_score)

    async def _search_pgvector(self, collection: str, partition: str, q: np.ndarray, k: int,
                               min_score: float) -> list[Hit]:
        v = self.vectors.c
        distance = v.embedding.op("<=>", return_type=sa.Float)(sa.bindparam("q", q.tolist(), type_=PgVector(self.dim)))
        stmt = (sa.select(v.key, v.text, v.meta, (1 - distance).label("score"))
                .where(self._in_partition(collection, partition)).order_by(distance).limit(k))
        async with self.engine.begin() as conn:
            # SET LOCAL, the three in one round trip. HNSW filters after its scan: without
            # iterative scans a partition's rows could be fewer than k among the ef_search nearest
            # of the whole table. And the search is planned for this partition, never from the
            # prepared statement's generic plan: one plan cannot fit a user's ten memories and a
            # conversation's 10,000 chunks (HNSW, or the partition's rows by its key and an exact
            # sort), and a generic one may read the whole table.
            await conn.execute(_PGVECTOR_SETTINGS, {"ef_search": str(max(40, 2 * k))})
            rows = (await conn.execute(stmt)).all()
        return [Hit(r.key, float(r.score), r.text, r.meta) for r in rows if r.score >= min_score]

    async def _search_exact(self, collection: str, partition: str, q: np.ndarray, k: int,
                            min_score: float) -> list[Hit]:
        p, v = self.partitions.c, self.vectors.c
        async with self.engine.connect() as conn:
            # The version first: rows read after it are at least that new, so a stale matrix is
            # never cached under a newer version.
            version = (await conn.execute(sa.select(p.version).where(
                p.collection == collection, p.partition == partition))).scalar()
            if version is None:
                return []
            cached = self._cache.get(collection, partition, version)
            if cached is None:
                rows = (await conn.execute(sa.select(v.key, v.embedding).where(
                    self._in_partition(collection, partition)))).all()
                matrix = (np.frombuffer(b"".join(r.embedding for r in rows), dtype=np.float32)
                          .reshape(len(rows), self.dim))
                cached = PartitionMatrix(version, [r.key for r in rows], matrix)
                self._cache.put(collection, partition, cached)
            best = top_k(cached.matrix, q, k, min_score)
            if not best:
                return []
            keys = [cached.keys[i] for i, _ in best]
            found = {r.key: r for r in (await conn.execute(sa.select(v.key, v.text, v.meta).where(
                self._in_partition(collection, partition), v.key.in_(keys)))).all()}
        return [Hit(key, score, found[key].text, found[key].meta)
                for key, (_, score) in zip(keys, best, strict=True) if key in found]
