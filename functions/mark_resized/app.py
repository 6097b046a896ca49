"""MarkResized: VERIFY_RESIZE with the new flavor, destination bindings active, migration finished."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.mark_resized, "MarkResized", resize.STEP_SCHEMA)
