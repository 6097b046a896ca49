"""ResizeInstanceAtSource: task resize_migrating, migration migrating, build resize_instance."""

from ferry.handlers import step_handler
from ferry.workflows import resize

handler = step_handler(resize.resize_instance_at_source, "ResizeInstanceAtSource", resize.STEP_SCHEMA)
