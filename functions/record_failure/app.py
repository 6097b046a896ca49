"""RecordFailure: note the failed attempt; ``{"retry": bool, "confirm": bool, …}``."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.record_failure, "RecordFailure", drain.SERVER_SCHEMA)
