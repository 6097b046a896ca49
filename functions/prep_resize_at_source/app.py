"""PrepResizeAtSource: set resize_migrating and build prep_snapshot_based_resize_at_source for the source host."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell, resize

handler = step_handler(cross_cell.prep_resize_at_source, "PrepResizeAtSource", resize.STEP_SCHEMA)
