"""BeginPowerAction: take an os-stop/os-start request before its host acts (refused if the API undid it)."""

from ferry.handlers import step_handler
from ferry.workflows import power

handler = step_handler(power.begin_power_action, "BeginPowerAction", power.POWER_EVENT_SCHEMA)
