"""SelectMoveDestinations: schedule a resize or cold migrate; the migration takes the source allocation."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.select_destinations, "SelectMoveDestinations", resize.STEP_SCHEMA)
