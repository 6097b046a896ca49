"""SettleServer: an iteration whose bookkeeping failed records its server failed (if not settled yet)."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.settle_server, "SettleServer", drain.SERVER_SCHEMA)
