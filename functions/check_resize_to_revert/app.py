"""CheckResizeToRevert: check that a revert is under way and name the source and destination hosts."""

from ferry.handlers import step_handler
from ferry.workflows import revert_resize
from ferry.workflows.confirm_resize import ANY_OBJECT

handler = step_handler(revert_resize.check_resize_to_revert, "CheckResizeToRevert", ANY_OBJECT)
