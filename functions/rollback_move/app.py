"""RollbackMove: put a failed resize or cold migrate back exactly as it was before the move."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.rollback_move, "RollbackMove", resize.ROLLBACK_SCHEMA)
