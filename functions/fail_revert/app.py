"""FailRevert: record a revert that failed after the destination was cleaned up (ERROR, and where things are)."""

from ferry.handlers import step_handler
from ferry.workflows import revert_resize

handler = step_handler(revert_resize.fail_revert, "FailRevert")
