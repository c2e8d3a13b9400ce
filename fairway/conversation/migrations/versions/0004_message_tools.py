"""messages.tools: a message's tool calls (assistant) or the call it answers (tool)

Revision ID: 0004
Revises: 0003
Create Date: 2025-01-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # An assistant message's calls ({"calls": [...]}, each at its offset in the text, with the
    # built-in tool's output), or a tool message's {"tool_call_id": ...}: with the text, what it
    # takes to render the conversation again as the model saw it.
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("tools", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("tools")
