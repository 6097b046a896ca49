"""request spec zones: forget zones no aggregate defines

Servers asked for a zone were not held to it before the scheduler's availability zone filter;
a zone that is not one (a typo, say) would now leave such a server nowhere to move. It is
cleared, so the server moves as one asked for no zone, as it always could.

Revision ID: 0006_api
Revises: 0005_api
Create Date: 2026-11-26 11:45:00.000000

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0006_api'
down_revision: str | Sequence[str] | None = '0005_api'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_ZONE = "nova"

request_specs = sa.table("request_specs", sa.column("id", sa.Integer), sa.column("spec", sa.JSON))
aggregate_metadata = sa.table("aggregate_metadata", sa.column("key", sa.String), sa.column("value", sa.String))


def upgrade() -> None:
    """Clear the availability zone of request specs that name no zone there is."""
    bind = op.get_bind()
    zones = {DEFAULT_ZONE, *bind.scalars(sa.select(aggregate_metadata.c.value)
                                         .where(aggregate_metadata.c.key == "availability_zone"))}
    for row_id, spec in bind.execute(sa.select(request_specs.c.id, request_specs.c.spec)).all():
        if isinstance(spec, dict) and spec.get("availability_zone") and spec["availability_zone"] not in zones:
            bind.execute(sa.update(request_specs).where(request_specs.c.id == row_id)
                         .values(spec={**spec, "availability_zone": None}))


def downgrade() -> None:
    """Nothing to undo: the zones cleared named no zone."""
