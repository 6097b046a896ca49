"""FinishCrossCellAtDest: set resize_finish and build spawn (from the snapshot) for the destination host."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.finish_resize_at_dest, "FinishCrossCellAtDest", resize.STEP_SCHEMA)
