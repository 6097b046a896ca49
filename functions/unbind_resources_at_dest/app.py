"""UnbindResourcesAtDest: rollback of BindResourcesAtDest."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.unbind_resources_at_dest, "UnbindResourcesAtDest")
