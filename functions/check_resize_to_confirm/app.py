"""CheckResizeToConfirm: check that a confirm is under way and name the source and destination hosts."""

from ferry.handlers import step_handler
from ferry.workflows import confirm_resize
from ferry.workflows.confirm_resize import ANY_OBJECT

handler = step_handler(confirm_resize.check_resize_to_confirm, "CheckResizeToConfirm", ANY_OBJECT)
