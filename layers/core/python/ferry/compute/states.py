"""Server states with Nova's names and the API status they show."""

from __future__ import annotations

from collections.abc import Iterable

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


# Nova's table of the status a vm_state shows with each task_state, ``DEFAULT`` standing for any
# other task (or none), for the states Ferry's servers take. A status filter selects through it.
DEFAULT = "default"
_RESIZING = {RESIZE_PREP: "RESIZE", RESIZE_MIGRATING: "RESIZE", RESIZE_MIGRATED: "RESIZE", RESIZE_FINISH: "RESIZE"}
_STATE_MAP: dict[str, dict[str, str]] = {
    ACTIVE: {DEFAULT: "ACTIVE", **_RESIZING},
    BUILDING: {DEFAULT: "BUILD"},
    STOPPED: {DEFAULT: "SHUTOFF", **_RESIZING},
    RESIZED: {DEFAULT: "VERIFY_RESIZE", RESIZE_REVERTING: "REVERT_RESIZE"},
    PAUSED: {DEFAULT: "PAUSED"},
    SUSPENDED: {DEFAULT: "SUSPENDED"},
    ERROR: {DEFAULT: "ERROR"},
    DELETED: {DEFAULT: "DELETED"},
}
# The statuses Nova shows that no Ferry server takes (reboots, rebuilds, rescue, shelving, live
# migration, soft delete): a filter by them is valid and finds nothing.
_OTHER_NOVA_STATUSES = frozenset({"REBOOT", "HARD_REBOOT", "PASSWORD", "REBUILD", "MIGRATING", "RESCUE",
                                  "SOFT_DELETED", "SHELVED", "SHELVED_OFFLOADED"})


def states_of_statuses(statuses: Iterable[str]) -> tuple[frozenset[str], frozenset[str] | None] | None:
    """The vm_states and task_states a ``status`` filter selects, as Nova turns one into them.

    Returns:
        ``(vm_states, task_states)``, the task_states None when a status stands for its vm_state
        whatever the task (``ACTIVE`` takes a server being resized or stopped too, as in Nova);
        both empty for statuses Nova knows and no Ferry server shows; None when no status is one
        Nova knows.
    """
    wanted = {status.upper() for status in statuses}
    vm_states: set[str] = set()
    task_states: set[str] = set()
    for vm_state, by_task in _STATE_MAP.items():
        for task_state, status in by_task.items():
            if status in wanted:
                vm_states.add(vm_state)
                task_states.add(task_state)
    if not vm_states and not wanted & _OTHER_NOVA_STATUSES:
        return None
    return frozenset(vm_states), None if DEFAULT in task_states else frozenset(task_states)


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
