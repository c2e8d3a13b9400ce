"""memory_conversations.extracted_messages: how many of a conversation's messages memory has read

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Each message is extracted once, so a memory the user deleted is not learnt again from the
    # messages it came from. 0 for the conversations noted before: the next extraction reads them
    # whole, as every extraction did until now. A database whose memory tables were made by
    # create_all (before 0006) may have the column already.
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("memory_conversations")}
    if "extracted_messages" in columns:
        return
    with op.batch_alter_table("memory_conversations") as batch:
        batch.add_column(sa.Column("extracted_messages", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("memory_conversations") as batch:
        batch.drop_column("extracted_messages")
