"""server groups: instance_groups and their members; a move's consumer names its instance; drains' request digests

``consumers.instance_uuid`` links a migration's consumer (the source host a move holds) to the
server it moves, so a server group counts a moving member on its source too. Moves under way
when the revision runs keep no link until they end.

``drains.request_digest`` is the SHA-256 of a drain's normalised request, so its idempotency
key used again with a different request is refused. Drains recorded before have none, and
their key names them whatever the request, as before.

Revision ID: 0010_api
Revises: 0009_api
Create Date: 2026-11-27 17:00:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0010_api'
down_revision: str | Sequence[str] | None = '0009_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add instance_groups, instance_group_members, consumers.instance_uuid and drains.request_digest."""
    op.create_table('instance_groups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('project_id', sa.String(length=255), nullable=False),
    sa.Column('user_id', sa.String(length=255), nullable=False),
    sa.Column('policy', sa.String(length=32), nullable=False),
    sa.Column('rules', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_instance_groups')),
    sa.UniqueConstraint('uuid', name=op.f('uq_instance_groups_uuid'))
    )
    op.create_index(op.f('ix_instance_groups_project_id'), 'instance_groups', ['project_id'], unique=False)
    op.create_table('instance_group_members',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.Integer(), nullable=False),
    sa.Column('instance_uuid', sa.String(length=36), nullable=False),
    sa.ForeignKeyConstraint(['group_id'], ['instance_groups.id'],
                            name=op.f('fk_instance_group_members_group_id_instance_groups'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_instance_group_members')),
    sa.UniqueConstraint('instance_uuid', name=op.f('uq_instance_group_members_instance_uuid'))
    )
    op.create_index(op.f('ix_instance_group_members_group_id'), 'instance_group_members', ['group_id'],
                    unique=False)
    with op.batch_alter_table('consumers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('instance_uuid', sa.String(length=36), nullable=True))
        batch_op.create_index(batch_op.f('ix_consumers_instance_uuid'), ['instance_uuid'], unique=False)
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.add_column(sa.Column('request_digest', sa.String(length=64), nullable=True))


def downgrade() -> None:
    """Drop drains.request_digest, the server group tables and consumers.instance_uuid."""
    with op.batch_alter_table('drains', schema=None) as batch_op:
        batch_op.drop_column('request_digest')
    with op.batch_alter_table('consumers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_consumers_instance_uuid'))
        batch_op.drop_column('instance_uuid')
    op.drop_index(op.f('ix_instance_group_members_group_id'), table_name='instance_group_members')
    op.drop_table('instance_group_members')
    op.drop_index(op.f('ix_instance_groups_project_id'), table_name='instance_groups')
    op.drop_table('instance_groups')
