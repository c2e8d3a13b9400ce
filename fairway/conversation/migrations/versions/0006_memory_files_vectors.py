"""memory's, files' and the vector index's tables, beside the conversations they serve

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Their parts (fairway/memory/store.py, fairway/files/store.py, fairway/retrieval/sql_index.py)
query them; they used to create them themselves (create_all), so a database from then has some
or all of them already: each table is made only where it is missing. The vectors' embedding is
pgvector's vector(384) (all-MiniLM-L6-v2's size), with an HNSW cosine index, when the PostgreSQL
server has the extension and it can be enabled here; else the vector's float32 bytes, searched
exactly.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

log = logging.getLogger(__name__)
EMBEDDING_DIM = 384
JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())

    def table(name: str, *columns: sa.SchemaItem, indexes: tuple[tuple[str, list[str]], ...] = ()) -> None:
        if name in existing:
            return
        op.create_table(name, *columns)
        for index, on in indexes:
            op.create_index(index, name, on)

    table("memories",
          sa.Column("memory_id", sa.String(64), primary_key=True),
          sa.Column("user_id", sa.String(128), nullable=False),
          sa.Column("fact", sa.Text, nullable=False),
          sa.Column("conversation_id", sa.String(64), nullable=True),
          sa.Column("created_at", sa.Double, nullable=False),
          sa.Column("updated_at", sa.Double, nullable=False),
          indexes=(("ix_memories_user_created", ["user_id", "created_at"]),))
    table("memory_users",
          sa.Column("user_id", sa.String(128), primary_key=True),
          sa.Column("enabled", sa.Boolean, nullable=False),
          sa.Column("updated_at", sa.Double, nullable=False))
    table("memory_conversations",
          sa.Column("conversation_id", sa.String(64), primary_key=True),
          sa.Column("user_id", sa.String(128), nullable=False),
          sa.Column("last_turn_at", sa.Double, nullable=False),
          sa.Column("extracted_at", sa.Double, nullable=True),
          sa.Column("block", JSON, nullable=True),
          indexes=(("ix_memory_conversations_pending", ["last_turn_at"]),))
    table("files",
          sa.Column("file_id", sa.String(64), primary_key=True),
          sa.Column("user_id", sa.String(128), nullable=False),
          sa.Column("filename", sa.Text, nullable=False),
          sa.Column("purpose", sa.String(64), nullable=False),
          sa.Column("content_type", sa.String(128), nullable=False),
          sa.Column("bytes", sa.BigInteger, nullable=False),
          sa.Column("status", sa.String(16), nullable=False),
          sa.Column("status_details", sa.Text, nullable=True),
          sa.Column("chunks", sa.Integer, nullable=False),
          sa.Column("object_key", sa.Text, nullable=False),
          sa.Column("created_at", sa.Double, nullable=False),
          indexes=(("ix_files_user_created", ["user_id", "created_at"]),))
    table("conversation_files",
          sa.Column("conversation_id", sa.String(64), nullable=False),
          sa.Column("file_id", sa.String(64), nullable=False),
          sa.Column("attached_at", sa.Double, nullable=False),
          sa.PrimaryKeyConstraint("conversation_id", "file_id", name="pk_conversation_files"),
          indexes=(("ix_conversation_files_file", ["file_id"]),))
    table("vector_partitions",
          sa.Column("collection", sa.String(32), nullable=False),
          sa.Column("partition", sa.String(128), nullable=False),
          sa.Column("version", sa.BigInteger, nullable=False),
          sa.PrimaryKeyConstraint("collection", "partition", name="pk_vector_partitions"))
    if "vectors" in existing:
        return
    table("vectors",
          sa.Column("collection", sa.String(32), nullable=False),
          sa.Column("partition", sa.String(128), nullable=False),
          sa.Column("key", sa.String(128), nullable=False),
          sa.Column("text", sa.Text, nullable=False),
          sa.Column("meta", JSON, nullable=False),
          sa.Column("embedding", sa.LargeBinary, nullable=False),
          sa.PrimaryKeyConstraint("collection", "partition", "key", name="pk_vectors"))
    if _pgvector():
        # The table is empty: its column changes type without a row to convert.
        op.execute(f"ALTER TABLE vectors ALTER COLUMN embedding TYPE vector({EMBEDDING_DIM}) USING NULL")
        op.execute("CREATE INDEX ix_vectors_hnsw ON vectors USING hnsw (embedding vector_cosine_ops)")


def _pgvector() -> bool:
    """Whether the server has pgvector and it is (or can be) enabled in this database."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    if bind.execute(sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).scalar() is None:
        return False
    try:
        with bind.begin_nested():
            bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS vector"))
    except sa.exc.DBAPIError as exc:  # no privilege: exact search still works
        log.warning("pgvector is installed but cannot be enabled (%s): exact search", exc.orig)
        return False
    return True


def downgrade() -> None:
    for name in ("vectors", "vector_partitions", "conversation_files", "files", "memory_conversations",
                 "memory_users", "memories"):
        op.drop_table(name)
