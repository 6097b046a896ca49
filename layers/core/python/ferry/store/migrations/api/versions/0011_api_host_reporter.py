"""host reporter: the sender a host's reports are taken from

A host's reports (heartbeats, inventories, the guests it holds) come through one queue every
agent may send to. A host mapping keeps who sent the first report of the host (SQS's
``SenderId``), and a report of the host from another sender is refused, so an agent cannot
report for another host. Hosts mapped before have none: the next report of each binds it.

Revision ID: 0011_api
Revises: 0010_api
Create Date: 2026-11-28 10:30:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0011_api'
down_revision: str | Sequence[str] | None = '0010_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add host_mappings.reporter."""
    with op.batch_alter_table('host_mappings', schema=None) as batch_op:
        batch_op.add_column(sa.Column('reporter', sa.String(length=255), nullable=True))


def downgrade() -> None:
    """Drop host_mappings.reporter."""
    with op.batch_alter_table('host_mappings', schema=None) as batch_op:
        batch_op.drop_column('reporter')
