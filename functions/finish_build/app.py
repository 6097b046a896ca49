"""FinishBuild: mark a spawned server ACTIVE."""

from ferry.handlers import step_handler
from ferry.workflows import boot

handler = step_handler(boot.finish_build, "FinishBuild")
