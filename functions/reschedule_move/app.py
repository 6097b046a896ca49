"""RescheduleMove: move a refused resize claim to the next alternate host."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.reschedule_move, "RescheduleMove", resize.STEP_SCHEMA)
