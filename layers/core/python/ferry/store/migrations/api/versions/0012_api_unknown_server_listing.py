"""instance_mappings: index a cell's servers by when they were accepted

From 2.69 a server list shows the servers of a cell whose database does not answer from their
mappings, newest first from the page marker's place on: without this index each page sorted
every mapping of that cell.

On PostgreSQL the index is built under the revision's lock on the table (writes to it wait
while it is built: seconds on a large deployment).

Revision ID: 0012_api
Revises: 0011_api
Create Date: 2026-11-28 12:45:00.000000

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0012_api'
down_revision: str | Sequence[str] | None = '0011_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = 'ix_instance_mappings_cell_listing'


def upgrade() -> None:
    """Index instance_mappings by (cell_id, queued_for_delete, created_at, instance_uuid)."""
    op.create_index(NAME, 'instance_mappings', ['cell_id', 'queued_for_delete', 'created_at', 'instance_uuid'])


def downgrade() -> None:
    """Drop the index."""
    op.drop_index(NAME, table_name='instance_mappings')
