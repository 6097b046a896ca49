"""PrepCrossCellAtDest: record the destination in both cells, bind ports inactive and reserve volumes there."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.prep_resize_at_dest, "PrepCrossCellAtDest", resize.STEP_SCHEMA)
