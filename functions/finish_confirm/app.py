"""FinishConfirm: drop the migration's allocation and the source's bindings and attachments; migration confirmed."""

from ferry.handlers import step_handler
from ferry.workflows import confirm_resize

handler = step_handler(confirm_resize.finish_confirm, "FinishConfirm")
