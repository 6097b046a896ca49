"""FinishDelete: release a destroyed server's ports, volumes and allocations."""

from ferry.handlers import step_handler
from ferry.workflows import delete

handler = step_handler(delete.finish_delete, "FinishDelete")
