"""BeginDrain: ``{"drain_uuid", "dry_run"}`` of the drain this execution runs."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.begin_drain, "BeginDrain", drain.BEGIN_SCHEMA)
