"""CompleteMoveAcrossCells: show the target copy, map the server there, hide the source copy, then
delete the temporary snapshot (best effort, once the move has committed)."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.complete_move, "CompleteMoveAcrossCells", resize.STEP_SCHEMA)
