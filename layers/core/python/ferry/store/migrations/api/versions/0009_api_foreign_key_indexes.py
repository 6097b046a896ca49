"""foreign-key indexes: the API tables' foreign-key columns that had no index get one

SQLite and PostgreSQL do not index a referencing column by themselves. Without one, a boot's
search for a network's used addresses, a volume's attachments, a cell's hosts, mappings or
providers, and every delete of a referenced row, read the whole table. The columns already
leading a unique constraint or an index (extra specs, aggregate hosts and metadata, flavor
projects, inventories, allocations, port bindings, drain servers) are indexed already.

On PostgreSQL each index is built under the revision's lock on its table (writes to it wait
while it is built: seconds on large tables).

Revision ID: 0009_api
Revises: 0008_api
Create Date: 2026-11-27 14:00:00.000000

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0009_api'
down_revision: str | Sequence[str] | None = '0008_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column) — the index is named by the models' naming convention: ix_<table>_<column>.
COLUMNS = (
    ('host_mappings', 'cell_id'),
    ('instance_mappings', 'cell_id'),
    ('resource_providers', 'cell_id'),
    ('ports', 'network_id'),
    ('volume_attachments', 'volume_id'),
)


def upgrade() -> None:
    """Index each foreign-key column of COLUMNS."""
    for table, column in COLUMNS:
        op.create_index(f'ix_{table}_{column}', table, [column])


def downgrade() -> None:
    """Drop the indexes."""
    for table, column in reversed(COLUMNS):
        op.drop_index(f'ix_{table}_{column}', table_name=table)
