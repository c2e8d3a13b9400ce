"""conversations.active_reply_id: the newest reply, which a new turn waits for

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # NULL for the conversations stored before: they take their next turn as they did (their
    # replies ended long ago, or the claim waits for none).
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("active_reply_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("active_reply_id")
