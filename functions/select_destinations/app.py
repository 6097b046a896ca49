"""SelectDestinations: schedule a new server and claim its host (boot workflow)."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.select_destinations, "SelectDestinations")
