"""ConfirmBeforeDelete: drop a deleted server's migration allocation and source bindings; migration confirmed."""

from ferry.handlers import step_handler
from ferry.workflows import delete

handler = step_handler(delete.confirm_before_delete, "ConfirmBeforeDelete")
