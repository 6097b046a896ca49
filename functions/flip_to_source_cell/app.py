"""FlipToSourceCell: a cross-cell revert makes the source cell's copy of the server the server again."""

from ferry.handlers import step_handler
from ferry.workflows import cross_cell_settle

handler = step_handler(cross_cell_settle.flip_to_source_cell, "FlipToSourceCell")
