"""flavor projects: the projects allowed to use each private flavor

Revision ID: 0005_api
Revises: 0004_api
Create Date: 2026-11-26 11:30:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0005_api'
down_revision: str | Sequence[str] | None = '0004_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add flavor_projects."""
    op.create_table('flavor_projects',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('flavor_id', sa.Integer(), nullable=False),
    sa.Column('project_id', sa.String(length=255), nullable=False),
    sa.ForeignKeyConstraint(['flavor_id'], ['flavors.id'], name=op.f('fk_flavor_projects_flavor_id_flavors'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_flavor_projects')),
    sa.UniqueConstraint('flavor_id', 'project_id', name=op.f('uq_flavor_projects_flavor_id'))
    )


def downgrade() -> None:
    """Drop flavor_projects."""
    op.drop_table('flavor_projects')
