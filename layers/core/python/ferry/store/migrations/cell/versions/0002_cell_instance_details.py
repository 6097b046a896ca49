"""instance details the owner gives a server: description (2.19), hostname (2.90), user data,
and the reservation id of the request that created it

Revision ID: 0002_cell
Revises: 0001_cell
Create Date: 2026-11-26 13:40:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0002_cell'
down_revision: str | Sequence[str] | None = '0001_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add instances.display_description, hostname, reservation_id and user_data."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('display_description', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('hostname', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('reservation_id', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('user_data', sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        for column in ('user_data', 'reservation_id', 'hostname', 'display_description'):
            batch_op.drop_column(column)
