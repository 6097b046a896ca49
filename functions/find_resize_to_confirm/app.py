"""FindResizeToConfirm: find the migration a delete must confirm first, if any."""

from ferry.handlers import step_handler
from ferry.workflows import delete

handler = step_handler(delete.find_resize_to_confirm, "FindResizeToConfirm")
