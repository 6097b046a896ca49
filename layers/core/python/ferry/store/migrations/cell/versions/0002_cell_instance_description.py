"""instance description: what the owner wrote about a server (2.19)

Revision ID: 0002_cell
Revises: 0001_cell
Create Date: 2026-11-26 13:40:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0002_cell'
down_revision: str | Sequence[str] | None = '0001_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add instances.display_description."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('display_description', sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop instances.display_description."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.drop_column('display_description')
