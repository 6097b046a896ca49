"""FinishDrain: settle the status, announce it, return the report."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.finish_drain, "FinishDrain", drain.DRAIN_SCHEMA)
