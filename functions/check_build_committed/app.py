"""CheckBuildCommitted: whether the build's failed last step had committed (then the build stands)."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.check_build_committed, "CheckBuildCommitted")
