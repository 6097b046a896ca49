"""CheckMoveCommitted: whether the move's failed last step had committed (then the move stands)."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.check_move_committed, "CheckMoveCommitted", resize.STEP_SCHEMA)
