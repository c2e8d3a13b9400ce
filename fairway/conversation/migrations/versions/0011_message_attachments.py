"""messages.attachments: the files a user message attached

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Each file as it was when sent ({file_id, filename, bytes, content_type}), so a reopened
    # conversation shows it on its message; NULL for a message without files, and for the messages
    # stored before, whose files were never recorded.
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("attachments", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("attachments")
