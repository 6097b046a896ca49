"""RescheduleBuild: move a failed build's claim to the next alternate host."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.reschedule_build, "RescheduleBuild")
