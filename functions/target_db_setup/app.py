"""TargetDBSetup: copy the server (hidden), its block devices, tags, actions and the migration into the target cell."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.target_db_setup, "TargetDBSetup", resize.STEP_SCHEMA)
