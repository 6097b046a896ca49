"""quotas: per-project limits set by an admin

Revision ID: 0002_api
Revises: 0001_api
Create Date: 2026-11-23 11:34:47.225001

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0002_api'
down_revision: str | Sequence[str] | None = '0001_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('quotas',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('project_id', sa.String(length=255), nullable=False),
    sa.Column('resource', sa.String(length=255), nullable=False),
    sa.Column('hard_limit', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_quotas')),
    sa.UniqueConstraint('project_id', 'resource', name=op.f('uq_quotas_project_id'))
    )
    with op.batch_alter_table('quotas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quotas_project_id'), ['project_id'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('quotas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_quotas_project_id'))

    op.drop_table('quotas')
