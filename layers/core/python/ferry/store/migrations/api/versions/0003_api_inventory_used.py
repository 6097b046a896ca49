"""inventory used: a per-inventory counter of allocated amounts, filled from the allocations

Revision ID: 0003_api
Revises: 0002_api
Create Date: 2026-12-02 10:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0003_api'
down_revision: str | Sequence[str] | None = '0002_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add inventories.used and set it to the sum of each inventory's allocations."""
    with op.batch_alter_table('inventories', schema=None) as batch_op:
        batch_op.add_column(sa.Column('used', sa.Integer(), server_default=sa.text('0'), nullable=False))
    op.execute(
        "UPDATE inventories SET used = COALESCE(("
        "SELECT SUM(allocations.used) FROM allocations"
        " WHERE allocations.resource_provider_id = inventories.resource_provider_id"
        " AND allocations.resource_class = inventories.resource_class), 0)"
    )


def downgrade() -> None:
    """Drop inventories.used."""
    with op.batch_alter_table('inventories', schema=None) as batch_op:
        batch_op.drop_column('used')
