"""FailConfirm: record a confirm that failed at the source: migration error, the server left usable, a fault."""

from ferry.handlers import step_handler
from ferry.workflows import confirm_resize

handler = step_handler(confirm_resize.fail_confirm, "FailConfirm")
