"""PrepareConfirm: accept the confirm; the nested confirm execution's name and input."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.prepare_confirm, "PrepareConfirm", drain.SERVER_SCHEMA)
