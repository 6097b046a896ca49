"""instance list indexes: servers are listed newest first, a page at a time

A server list in its default order reads each cell's servers by creation time and uuid from the
page marker's place on (every project's for an admin, one project's otherwise); without these
indexes each page sorted the whole table.

On PostgreSQL the indexes are built under the revision's lock on the table (writes to it wait
while they are built: seconds on a large cell).

Revision ID: 0008_cell
Revises: 0007_cell
Create Date: 2026-11-28 10:00:00.000000

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0008_cell'
down_revision: str | Sequence[str] | None = '0007_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {'ix_instances_deleted_created_at_uuid': ['deleted', 'created_at', 'uuid'],
           'ix_instances_project_id_deleted_created_at_uuid': ['project_id', 'deleted', 'created_at', 'uuid']}


def upgrade() -> None:
    """Index instances by (deleted, created_at, uuid) and by (project_id, deleted, created_at, uuid)."""
    for name, columns in INDEXES.items():
        op.create_index(name, 'instances', columns)


def downgrade() -> None:
    """Drop the indexes."""
    for name in reversed(INDEXES):
        op.drop_index(name, table_name='instances')
