"""AcquireSlot: ``move``, ``wait`` or ``stop`` for one server, and whether to confirm."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.acquire_slot, "AcquireSlot", drain.SERVER_SCHEMA)
