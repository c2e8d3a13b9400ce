"""SQLAlchemy Core tables the queries are written against. The migrations create them (and
must stay in step: tests compare a migrated database with this metadata, and with memory's,
files' and the vector index's, whose tables the migrations create in the same database)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()

# JSONB on PostgreSQL (compact, binary), JSON text on SQLite; None is SQL NULL, not JSON null.
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")

conversations = sa.Table(
    "conversations",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("tier", sa.String(32), nullable=False),
    sa.Column("model", sa.String(128), nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    # Its newest reply: until that one has ended the conversation takes no new turn (the store's
    # claim, sql_store.py), so each turn's context holds every reply before it.
    sa.Column("active_reply_id", sa.String(64), nullable=True),
    sa.Index("ix_conversations_user_updated", "user_id", "updated_at"),
)

# Partitioned by conversation_id on PostgreSQL, so conversation_id leads every key.
messages = sa.Table(
    "messages",
    metadata,
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
    sa.Column("tools", Json, nullable=True),  # its tool calls, or the call a tool message answers
    sa.Column("flagged_categories", Json, nullable=True),  # flagged: by which moderation categories
    sa.Column("attachments", Json, nullable=True),  # a user message's files: [{file_id, filename, ...}]
    sa.PrimaryKeyConstraint("conversation_id", "id", name="pk_messages"),
    sa.UniqueConstraint("conversation_id", "client_key", name="uq_messages_client_key"),
    sa.Index("ix_messages_conversation_created", "conversation_id", "created_at"),
)

replies = sa.Table(
    "replies",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("conversation_id", sa.String(64), sa.ForeignKey("conversations.id"), nullable=False),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("replica_id", sa.String(128), nullable=True),
    sa.Column("last_event_id", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("finish_reason", sa.String(32), nullable=True),
    sa.Column("prompt_token_ids", Json, nullable=True),
    sa.Column("context_text", sa.Text, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("finished_at", sa.Double, nullable=True),
    sa.Column("job", Json, nullable=True),  # model, sampling, lane: enough to run it again
    # Times it ran again from its stored context after its token log was lost (its events' ids
    # carry it: gateway/cursor.py).
    sa.Column("restarts", sa.Integer, nullable=False, server_default="0"),
    sa.ForeignKeyConstraint(
        ["conversation_id", "message_id"],
        ["messages.conversation_id", "messages.id"],
        name="fk_replies_message",
    ),
    sa.Index("ix_replies_conversation_message", "conversation_id", "message_id"),
    # Only live replies are indexed: the few a restart must resume, not the history.
    sa.Index(
        "ix_replies_unfinished",
        "created_at",
        postgresql_where=sa.text("finished_at IS NULL"),
        sqlite_where=sa.text("finished_at IS NULL"),
    ),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("tier", sa.String(32), nullable=False),
    sa.Column("key_hash", sa.String(64), nullable=False),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("revoked_at", sa.Double, nullable=True),
    sa.Column("region", sa.String(64), nullable=True),
    sa.UniqueConstraint("key_hash", name="uq_api_keys_hash"),
    sa.Index("ix_api_keys_user", "user_id"),
)

usage_records = sa.Table(
    "usage_records",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("reply_id", sa.String(64), nullable=False),
    sa.Column("user_id", sa.String(128), nullable=False),
    sa.Column("model", sa.String(128), nullable=False),
    sa.Column("tier", sa.String(32), nullable=False),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("ttft_s", sa.Double, nullable=True),
    sa.Column("duration_s", sa.Double, nullable=False),
    sa.Column("finish_reason", sa.String(32), nullable=False),
    sa.Column("cost", sa.Double, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("day", sa.String(10), nullable=False),
    # One record per reply, whoever records it and however often its report arrives.
    sa.UniqueConstraint("reply_id", name="uq_usage_records_reply"),
    sa.Index("ix_usage_records_user_day", "user_id", "day"),
)
