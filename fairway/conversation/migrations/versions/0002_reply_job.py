"""replies.job: the generation request (model, sampling, lane) kept with the reply

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # With prompt_token_ids this is everything needed to run the reply again once its token log
    # has expired (or its replica died), without the client re-sending anything.
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("job", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("job")
