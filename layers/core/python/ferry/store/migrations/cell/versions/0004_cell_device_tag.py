"""block device tag: the tag a volume was attached with (2.49)

Revision ID: 0004_cell
Revises: 0003_cell
Create Date: 2026-11-26 14:45:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0004_cell'
down_revision: str | Sequence[str] | None = '0003_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add block_device_mappings.tag."""
    with op.batch_alter_table('block_device_mappings', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tag', sa.String(length=255), nullable=True))


def downgrade() -> None:
    """Drop block_device_mappings.tag."""
    with op.batch_alter_table('block_device_mappings', schema=None) as batch_op:
        batch_op.drop_column('tag')
