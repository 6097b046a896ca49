"""drain announced at: when a drain's end was announced

A drain whose end is final but not announced is announced again when someone looks at it after
its workflow ended. The drains that ended before this column existed are taken as announced
when they ended: whether their end went out is not known, and announcing every one of them
again at the first look after the upgrade would repeat ends long past.

Revision ID: 0007_api
Revises: 0006_api
Create Date: 2026-11-27 10:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0007_api'
down_revision: str | Sequence[str] | None = '0006_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The drain statuses that are final (planned is a dry run's end).
FINAL_STATUSES = ("planned", "cancelled", "completed", "failed")

drains = sa.table("drains", sa.column("status", sa.String), sa.column("created_at", sa.DateTime),
                  sa.column("updated_at", sa.DateTime), sa.column("finished_at", sa.DateTime),
                  sa.column("announced_at", sa.DateTime))


def upgrade() -> None:
    """Add drains.announced_at, set to when each drain already final ended."""
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.add_column(sa.Column('announced_at', sa.DateTime(), nullable=True))
    op.execute(sa.update(drains).where(drains.c.status.in_(FINAL_STATUSES))
               .values(announced_at=sa.func.coalesce(drains.c.finished_at, drains.c.updated_at,
                                                     drains.c.created_at)))


def downgrade() -> None:
    """Drop drains.announced_at."""
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.drop_column('announced_at')
