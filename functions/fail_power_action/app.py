"""FailPowerAction: clear the task state of a failed os-stop/os-start."""

from ferry.handlers import step_handler
from ferry.workflows import power

handler = step_handler(power.fail_power_action, "FailPowerAction", power.POWER_EVENT_SCHEMA)
