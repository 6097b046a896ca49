"""RevertResourcesToSource: move allocations, ports, volumes and the instance record back to the source."""

from ferry.handlers import step_handler
from ferry.workflows import revert_resize

handler = step_handler(revert_resize.revert_resources_to_source, "RevertResourcesToSource")
