"""FinishPowerAction: record the power state a host reported after os-stop/os-start."""

from ferry.handlers import step_handler
from ferry.workflows import power

handler = step_handler(power.finish_power_action, "FinishPowerAction", power.POWER_EVENT_SCHEMA)
