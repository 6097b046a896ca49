"""CheckVolumeCommitted: whether a volume operation's failed last step had committed (then it stands)."""

from ferry.handlers import step_handler
from ferry.workflows import volume_attachment

handler = step_handler(volume_attachment.check_volume_committed, "CheckVolumeCommitted")
