"""inventory reported at: when the host report a provider's inventory came from was queued

Host reports are applied several batches at a time: two reports of one host may be applied side
by side, and the older one finish last. A provider keeps when its inventory's report was queued,
and an older report's inventory is not written over it. Providers that exist have none yet: the
next report of their host sets it.

Revision ID: 0008_api
Revises: 0007_api
Create Date: 2026-11-27 12:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0008_api'
down_revision: str | Sequence[str] | None = '0007_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add resource_providers.inventory_reported_at."""
    with op.batch_alter_table('resource_providers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inventory_reported_at', sa.DateTime(), nullable=True))


def downgrade() -> None:
    """Drop resource_providers.inventory_reported_at."""
    with op.batch_alter_table('resource_providers', schema=None) as batch_op:
        batch_op.drop_column('inventory_reported_at')
