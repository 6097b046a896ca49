"""FailVolumeOperation: roll back the records of a failed volume attach or detach and clear the task."""

from ferry.handlers import step_handler
from ferry.workflows import volume_attachment

handler = step_handler(volume_attachment.fail_volume_operation, "FailVolumeOperation")
