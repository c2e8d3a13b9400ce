"""messages.flagged_categories: the moderation categories that flagged a message

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A user message the input check refused, or a reply the output check stopped: which of
    # OpenAI's moderation categories did it (a list of their names); NULL for any other message.
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("flagged_categories", sa.JSON().with_variant(JSONB(), "postgresql"),
                                   nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("flagged_categories")
