"""Server states with Nova's names and the API status they show."""

from __future__ import annotations

# vm_state
ACTIVE = "active"
BUILDING = "building"
STOPPED = "stopped"
RESIZED = "resized"
ERROR = "error"
DELETED = "deleted"
SUSPENDED = "suspended"
PAUSED = "paused"

# task_state
SCHEDULING = "scheduling"
SPAWNING = "spawning"
POWERING_OFF = "powering-off"
POWERING_ON = "powering-on"
DELETING = "deleting"
RESIZE_PREP = "resize_prep"
RESIZE_MIGRATING = "resize_migrating"
RESIZE_MIGRATED = "resize_migrated"
RESIZE_FINISH = "resize_finish"
RESIZE_REVERTING = "resize_reverting"
RESIZE_CONFIRMING = "resize_confirming"

# What os-resetState may set a server's vm_state to, by the name the request gives.
RESET_STATES = {"active": ACTIVE, "error": ERROR}

# power_state (libvirt-derived numbers, as Nova)
NOSTATE = 0
RUNNING = 1
PAUSED_POWER = 3
SHUTDOWN = 4
CRASHED = 6
SUSPENDED_POWER = 7

POWER_STATE_NAMES = {NOSTATE: "NOSTATE", RUNNING: "Running", PAUSED_POWER: "Paused", SHUTDOWN: "Shutdown",
                     CRASHED: "Crashed", SUSPENDED_POWER: "Suspended"}

_STATUS_BY_VM_STATE = {
    ACTIVE: "ACTIVE",
    BUILDING: "BUILD",
    STOPPED: "SHUTOFF",
    RESIZED: "VERIFY_RESIZE",
    ERROR: "ERROR",
    DELETED: "DELETED",
    SUSPENDED: "SUSPENDED",
    PAUSED: "PAUSED",
}

_STATUS_BY_TASK_STATE = {
    RESIZE_PREP: "RESIZE",
    RESIZE_MIGRATING: "RESIZE",
    RESIZE_MIGRATED: "RESIZE",
    RESIZE_FINISH: "RESIZE",
    RESIZE_REVERTING: "REVERT_RESIZE",
}


def api_status(vm_state: str, task_state: str | None) -> str:
    """The ``status`` the compute API shows for a vm_state/task_state pair (Nova's table)."""
    if vm_state == ERROR:
        return "ERROR"
    if vm_state == DELETED:
        return "DELETED"
    if task_state in _STATUS_BY_TASK_STATE:
        return _STATUS_BY_TASK_STATE[task_state]
    if vm_state == RESIZED and task_state == RESIZE_REVERTING:
        return "REVERT_RESIZE"
    return _STATUS_BY_VM_STATE.get(vm_state, "UNKNOWN")


def vm_state_from_power(power_state: int) -> str:
    """The vm_state a settled server takes from its power state (confirm/revert rules)."""
    return STOPPED if power_state == SHUTDOWN else ACTIVE
