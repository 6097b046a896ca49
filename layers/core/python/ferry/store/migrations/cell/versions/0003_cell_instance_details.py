"""instance details kept from create: hostname (2.90), the create request's reservation id, user data

Servers that exist get a hostname made from their name, as new ones without one do, and a
reservation id of their own.

Revision ID: 0003_cell
Revises: 0002_cell
Create Date: 2026-11-26 14:10:00.000000

"""
import re
import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0003_cell'
down_revision: str | Sequence[str] | None = '0002_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Servers filled in per statement: small enough for SQLite's oldest limit of 999 bound values
# (five per server), and each statement short on PostgreSQL.
BATCH = 100
# What ferry.compute.instances made at this revision, copied so that the migration's result never
# changes with that module.
HOSTNAME_LENGTH = 63
RESERVATION_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def upgrade() -> None:
    """Add instances.hostname, reservation_id and user_data; fill the first two in."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hostname', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('reservation_id', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('user_data', sa.Text(), nullable=True))
    _fill_in(op.get_bind())


def _fill_in(connection: sa.Connection) -> None:
    """Give every server without a hostname one made from its name, and a reservation id of its
    own: ``BATCH`` servers per statement, in id order."""
    instances = sa.table('instances', sa.column('id', sa.Integer), sa.column('uuid', sa.String),
                         sa.column('display_name', sa.String), sa.column('hostname', sa.String),
                         sa.column('reservation_id', sa.String))
    last_id = 0
    while True:
        rows = connection.execute(sa.select(instances.c.id, instances.c.uuid, instances.c.display_name)
                                  .where(instances.c.hostname.is_(None), instances.c.id > last_id)
                                  .order_by(instances.c.id).limit(BATCH)).all()
        if not rows:
            return
        hostnames = {row.id: _default_hostname(row.display_name or "", row.uuid) for row in rows}
        reservations = {row.id: _new_reservation_id() for row in rows}
        connection.execute(instances.update().where(instances.c.id.in_(list(hostnames))).values(
            hostname=sa.case(hostnames, value=instances.c.id),
            reservation_id=sa.case(reservations, value=instances.c.id)))
        last_id = rows[-1].id


def _new_reservation_id() -> str:
    """A create request's id, as Nova makes them: ``r-`` and eight lower-case letters or digits."""
    return "r-" + "".join(secrets.choice(RESERVATION_ALPHABET) for _ in range(8))


def _default_hostname(name: str, instance_uuid: str) -> str:
    """The hostname a server gets when it asks for none, made from its name as Nova makes it:
    Latin-1 only, spaces, underscores and dots become hyphens, other characters that are not
    word characters go, lower case, no hyphen or dot at either end, at most 63 characters;
    ``Server-<uuid>`` when nothing is left."""
    latin = name.encode("latin-1", "ignore").decode("latin-1")[:HOSTNAME_LENGTH]
    hostname = re.sub(r"[^\w.-]+", "", re.sub(r"[ _.]", "-", latin)).lower().strip(".-")
    return hostname or f"Server-{instance_uuid}"[:HOSTNAME_LENGTH]


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table('instances', schema=None) as batch_op:
        for column in ('user_data', 'reservation_id', 'hostname'):
            batch_op.drop_column(column)
