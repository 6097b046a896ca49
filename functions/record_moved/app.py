"""RecordMoved: the server is on its new host (confirmed unless the drain keeps VERIFY_RESIZE)."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.record_moved, "RecordMoved", drain.SERVER_SCHEMA)
