"""replies.restarts: how many times a reply ran again after its token log was lost

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # 0 for the replies stored before: none of them has been counted as restarted, and their
    # clients' event ids are the log's own (gateway/cursor.py).
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("restarts", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("restarts")
