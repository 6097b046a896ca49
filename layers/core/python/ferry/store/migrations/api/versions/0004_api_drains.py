"""drains: operators' requests to empty hosts or cells, and their servers

Revision ID: 0004_api
Revises: 0003_api
Create Date: 2026-11-23 10:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0004_api'
down_revision: str | Sequence[str] | None = '0003_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add drains and drain_servers."""
    op.create_table('drains',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=36), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('target_kind', sa.String(length=16), nullable=False),
    sa.Column('targets', sa.JSON(), nullable=False),
    sa.Column('reason', sa.String(length=255), nullable=True),
    sa.Column('dry_run', sa.Boolean(), nullable=False),
    sa.Column('options', sa.JSON(), nullable=False),
    sa.Column('allow_cross_cell', sa.Boolean(), nullable=False),
    sa.Column('fits', sa.Boolean(), nullable=True),
    sa.Column('disabled_hosts', sa.JSON(), nullable=False),
    sa.Column('origin', sa.String(length=32), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('project_id', sa.String(length=255), nullable=False),
    sa.Column('roles', sa.JSON(), nullable=False),
    sa.Column('request_id', sa.String(length=255), nullable=False),
    sa.Column('execution_name', sa.String(length=80), nullable=True),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_drains')),
    sa.UniqueConstraint('uuid', name=op.f('uq_drains_uuid')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_drains_idempotency_key'))
    )
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_drains_status'), ['status'], unique=False)
    op.create_table('drain_servers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('drain_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('instance_uuid', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=True),
    sa.Column('cell', sa.String(length=255), nullable=False),
    sa.Column('source_host', sa.String(length=255), nullable=False),
    sa.Column('vm_state', sa.String(length=255), nullable=True),
    sa.Column('planned_host', sa.String(length=255), nullable=True),
    sa.Column('planned_cell', sa.String(length=255), nullable=True),
    sa.Column('dest_host', sa.String(length=255), nullable=True),
    sa.Column('state', sa.String(length=32), nullable=False),
    sa.Column('migration_uuid', sa.String(length=36), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['drain_id'], ['drains.id'], name=op.f('fk_drain_servers_drain_id_drains'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_drain_servers')),
    sa.UniqueConstraint('drain_id', 'instance_uuid', name=op.f('uq_drain_servers_drain_id'))
    )
    with op.batch_alter_table('drain_servers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_drain_servers_drain_id'), ['drain_id'], unique=False)


def downgrade() -> None:
    """Drop drain_servers and drains."""
    with op.batch_alter_table('drain_servers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_drain_servers_drain_id'))
    op.drop_table('drain_servers')
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_drains_status'))
    op.drop_table('drains')
