"""CompleteMoveAcrossCells: delete the snapshot, show the target copy, map the server there, hide the source copy."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.complete_move, "CompleteMoveAcrossCells", resize.STEP_SCHEMA)
