"""PlanDrain: disable the targets, plan, and say whether to move (see :func:`ferry.drains.start`)."""

from ferry.handlers import step_handler
from ferry.workflows import drain

handler = step_handler(drain.plan_drain, "PlanDrain", drain.DRAIN_SCHEMA)
