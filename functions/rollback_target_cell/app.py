"""RollbackTargetCell: map the server back to the source cell, drop the target cell's copies, then
delete the temporary snapshot (best effort)."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.rollback_target_cell, "RollbackTargetCell", resize.ROLLBACK_SCHEMA)
