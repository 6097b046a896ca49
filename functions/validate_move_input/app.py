"""ValidateMoveInput: check a resize execution's input and the records the API prepared (changes nothing)."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.validate_input, "ValidateMoveInput", resize.VALIDATE_EVENT_SCHEMA)
