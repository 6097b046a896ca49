"""BindResourcesAtDest: bind ports and volumes to the destination and build the guest spec."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.bind_resources_at_dest, "BindResourcesAtDest")
