"""conversations, messages (hash-partitioned on PostgreSQL), replies

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

# Messages are the bulk of the data (~2.4 KB a turn) and are always read by conversation, so
# PostgreSQL spreads them over hash partitions of conversation_id: each partition's indexes
# stay small and a conversation's turns live in one of them. Changing the count rewrites the
# table, hence a constant frozen in this revision.
MESSAGE_PARTITIONS = 8


def _is_postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user_id", sa.String(128), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("ix_conversations_user_updated", "conversations", ["user_id", "updated_at"])

    # The primary key and every unique constraint include conversation_id: PostgreSQL
    # requires the partition key in them. SQLite ignores the partitioning argument.
    op.create_table(
        "messages",
        sa.Column("conversation_id", sa.String(64), sa.ForeignKey("conversations.id"), nullable=False),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("client_key", sa.String(128), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("reply_id", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", "id", name="pk_messages"),
        sa.UniqueConstraint("conversation_id", "client_key", name="uq_messages_client_key"),
        postgresql_partition_by="HASH (conversation_id)",
    )
    if _is_postgres():
        for n in range(MESSAGE_PARTITIONS):
            op.execute(
                f"CREATE TABLE messages_p{n} PARTITION OF messages "
                f"FOR VALUES WITH (MODULUS {MESSAGE_PARTITIONS}, REMAINDER {n})"
            )
    op.create_index("ix_messages_conversation_created", "messages", ["conversation_id", "created_at"])

    op.create_table(
        "replies",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("conversation_id", sa.String(64), sa.ForeignKey("conversations.id"), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("replica_id", sa.String(128), nullable=True),
        sa.Column("last_event_id", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("prompt_token_ids", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True),
        sa.Column("context_text", sa.Text, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.ForeignKeyConstraint(
            ["conversation_id", "message_id"],
            ["messages.conversation_id", "messages.id"],
            name="fk_replies_message",
        ),
    )
    op.create_index("ix_replies_conversation_message", "replies", ["conversation_id", "message_id"])
    op.create_index(
        "ix_replies_unfinished",
        "replies",
        ["created_at"],
        postgresql_where=sa.text("finished_at IS NULL"),
        sqlite_where=sa.text("finished_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_table("replies")
    op.drop_table("messages")  # its partitions go with it
    op.drop_table("conversations")
