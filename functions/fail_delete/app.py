"""FailDelete: record a failed delete so it can be retried."""

from ferry.handlers import step_handler
from ferry.workflows import delete

handler = step_handler(delete.fail_delete, "FailDelete")
