"""PrepResizeAtDest: record the destination, bind ports inactive and reserve volumes there, build prep_resize."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.prep_resize_at_dest, "PrepResizeAtDest", resize.STEP_SCHEMA)
