"""RestoreVerifyResize: put a confirm or revert that failed early back to VERIFY_RESIZE (migration finished)."""

from ferry.handlers import step_handler
from ferry.workflows import confirm_resize

handler = step_handler(confirm_resize.restore_verify_resize, "RestoreVerifyResize")
