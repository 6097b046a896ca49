"""FinishResizeAtDest: switch the server to the destination, task resize_finish, build finish_resize."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.finish_resize_at_dest, "FinishResizeAtDest", resize.STEP_SCHEMA)
