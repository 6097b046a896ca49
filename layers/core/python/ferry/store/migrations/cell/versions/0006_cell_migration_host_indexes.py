"""migration host indexes: migrations are found by their source and destination host

A service's delete, a drain and `GET /os-migrations?host=` ask for a host's migrations by
source_compute or dest_compute; without an index each read the whole table, which only grows.

On PostgreSQL the indexes are built under the revision's lock on the table (writes to it wait
while they are built: seconds on a large cell).

Revision ID: 0006_cell
Revises: 0005_cell
Create Date: 2026-11-27 14:00:00.000000

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0006_cell'
down_revision: str | Sequence[str] | None = '0005_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ('source_compute', 'dest_compute')


def upgrade() -> None:
    """Index migrations.source_compute and migrations.dest_compute."""
    for column in COLUMNS:
        op.create_index(f'ix_migrations_{column}', 'migrations', [column])


def downgrade() -> None:
    """Drop the indexes."""
    for column in reversed(COLUMNS):
        op.drop_index(f'ix_migrations_{column}', table_name='migrations')
