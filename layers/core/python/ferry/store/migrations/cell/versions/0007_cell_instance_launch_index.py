"""instance launch index: a server's place among the servers of its create request

A create request with ``max_count`` above 1 makes several servers; each keeps its index
(0 for the first), shown to admins as ``OS-EXT-SRV-ATTR:launch_index`` from 2.3. Servers
made before this revision have none and show 0, as they were shown.

Revision ID: 0007_cell
Revises: 0006_cell
Create Date: 2026-11-27 20:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0007_cell'
down_revision: str | Sequence[str] | None = '0006_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add instances.launch_index."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('launch_index', sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop instances.launch_index."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.drop_column('launch_index')
