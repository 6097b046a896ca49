"""instances: drop the indexes the list indexes of 0008_cell begin with

``ix_instances_deleted`` and ``ix_instances_project_id`` index the first column of
``ix_instances_deleted_created_at_uuid`` and ``ix_instances_project_id_deleted_created_at_uuid``:
every read they served, those serve, so they only cost each write to a server.

Revision ID: 0009_cell
Revises: 0008_cell
Create Date: 2026-11-28 12:30:00.000000

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0009_cell'
down_revision: str | Sequence[str] | None = '0008_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {'ix_instances_deleted': ['deleted'], 'ix_instances_project_id': ['project_id']}


def upgrade() -> None:
    """Drop the single-column indexes on deleted and on project_id."""
    for name in INDEXES:
        op.drop_index(name, table_name='instances')


def downgrade() -> None:
    """Index deleted and project_id on their own again."""
    for name, columns in INDEXES.items():
        op.create_index(name, 'instances', columns)
