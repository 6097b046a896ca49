"""FailBuild: release the claim of a failed build, set ERROR, record the fault."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.fail_build, "FailBuild")
