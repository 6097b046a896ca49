"""FinishRevert: the reverted server settles as it was before the resize; migration reverted."""

from ferry.handlers import step_handler
from ferry.workflows import revert_resize

handler = step_handler(revert_resize.finish_revert, "FinishRevert")
