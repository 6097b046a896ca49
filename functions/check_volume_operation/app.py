"""CheckVolumeOperation: check that a volume attach or detach is under way and build the host's arguments."""

from ferry.handlers import step_handler
from ferry.workflows import volume_attachment
from ferry.workflows.confirm_resize import ANY_OBJECT

handler = step_handler(volume_attachment.check_volume_operation, "CheckVolumeOperation", ANY_OBJECT)
