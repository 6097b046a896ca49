"""PrepareMove: accept the cold migration; the nested resize execution's name and input."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.prepare_move, "PrepareMove", drain.SERVER_SCHEMA)
