"""instance details kept from create: hostname (2.90), the create request's reservation id, user data

Servers that exist get a hostname made from their name, as new ones without one do, and a
reservation id of their own.

Revision ID: 0003_cell
Revises: 0002_cell
Create Date: 2026-11-26 14:10:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from ferry.compute.instances import default_hostname, new_reservation_id

# revision identifiers, used by Alembic.
revision: str = '0003_cell'
down_revision: str | Sequence[str] | None = '0002_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add instances.hostname, reservation_id and user_data; fill the first two in."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hostname', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('reservation_id', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('user_data', sa.Text(), nullable=True))
    instances = sa.table('instances', sa.column('id', sa.Integer), sa.column('uuid', sa.String),
                         sa.column('display_name', sa.String), sa.column('hostname', sa.String),
                         sa.column('reservation_id', sa.String))
    connection = op.get_bind()
    rows = connection.execute(sa.select(instances.c.id, instances.c.uuid, instances.c.display_name)
                              .where(instances.c.hostname.is_(None))).all()
    for row in rows:
        connection.execute(instances.update().where(instances.c.id == row.id).values(
            hostname=default_hostname(row.display_name or "", row.uuid), reservation_id=new_reservation_id()))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        for column in ('user_data', 'reservation_id', 'hostname'):
            batch_op.drop_column(column)
