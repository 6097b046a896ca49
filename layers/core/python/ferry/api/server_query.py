"""The server list's query string: which parameters are read, for whom, from which microversion.

As in Nova, a filter meant for admins is dropped (not refused) when a member sends it, a
parameter newer than the request's microversion is ignored, and from 2.75 a parameter Nova
does not know is refused (400). A parameter Nova knows but Ferry cannot filter by is refused
too, whoever may use it: a list must never look filtered when it is not.

Deleted servers are listed as Nova lists them: with ``changes-since`` or ``changes-before``
(whoever asks), and for an admin's ``deleted=true`` (only them; any other value of ``deleted``
leaves them out, even with a time window), and for ``status=DELETED`` alone: an admin's lists
deleted servers only, a member's is refused (403). ``soft_deleted`` is taken and changes nothing: Ferry has no soft
delete, so no server is ``SOFT_DELETED``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ferry import errors
from ferry.api import request
from ferry.api.request import ViewContext
from ferry.compute import states
from ferry.compute.server_filters import (
    ADMIN_SORT_KEYS,
    SORT_DIRECTIONS,
    SORT_KEYS,
    MatchBudget,
    ReadDeleted,
    SearchPattern,
    ServerFilters,
)

# Parameter → (the microversion it exists from, the one members may use it from; None: admins only).
PARAMETERS: Mapping[str, tuple[str, str | None]] = {
    **{name: ("2.1", "2.1") for name in ("name", "status", "image", "flavor", "ip", "changes-since", "all_tenants",
                                         "limit", "marker", "sort_key", "sort_dir", "reservation_id")},
    "ip6": ("2.1", "2.5"),
    **{name: ("2.26", "2.26") for name in ("tags", "tags-any", "not-tags", "not-tags-any")},
    "changes-before": ("2.66", "2.66"),
    "locked": ("2.73", "2.73"),
    **{name: ("2.1", "2.83") for name in ("availability_zone", "config_drive", "key_name", "created_at",
                                          "launched_at", "terminated_at", "power_state", "task_state", "vm_state",
                                          "progress", "user_id")},
    "hostname": ("2.1", "2.90"),
    **{name: ("2.1", None) for name in ("project_id", "tenant_id", "host", "node", "uuid", "deleted", "soft_deleted",
                                        "kernel_id", "ramdisk_id", "root_device_name", "launch_index",
                                        "access_ip_v4", "access_ip_v6", "auto_disk_config", "locked_by",
                                        "description", "display_name", "display_description", "image_ref",
                                        "instance_name")},
    "pinned_availability_zone": ("2.96", "2.96"),
}
# Known to Nova, not filtered by in Ferry.
UNSUPPORTED = frozenset({
    "config_drive", "created_at", "launched_at", "terminated_at", "progress",
    "kernel_id", "ramdisk_id", "root_device_name", "launch_index", "access_ip_v4", "access_ip_v6",
    "auto_disk_config", "locked_by", "description", "instance_name", "pinned_availability_zone"})


# Sort keys Nova accepts (those Ferry cannot sort by are refused with a clear message) and
# those it accepts and ignores.
NOVA_SORT_KEYS = frozenset({
    "access_ip_v4", "access_ip_v6", "auto_disk_config", "availability_zone", "config_drive", "created_at",
    "display_description", "display_name", "host", "hostname", "image_ref", "instance_type_id", "kernel_id",
    "key_name", "launch_index", "launched_at", "locked_by", "node", "power_state", "progress", "project_id",
    "ramdisk_id", "root_device_name", "task_state", "terminated_at", "updated_at", "user_id",
    "uuid", "vm_state"})
# Nova takes and ignores these until 2.75 (``locked`` until 2.73, a sort key from then on), and
# refuses them from 2.75.
IGNORED_SORT_KEYS = frozenset({
    "architecture", "cell_name", "cleaned", "default_ephemeral_device", "default_swap_device", "deleted",
    "deleted_at", "disable_terminate", "ephemeral_gb", "ephemeral_key_uuid", "id", "key_data", "launched_on",
    "locked", "memory_mb", "os_type", "reservation_id", "root_gb", "shutdown_terminate", "user_data", "vcpus",
    "vm_mode"})


def parse(view: ViewContext, params: Mapping[str, list[str]]) -> ServerFilters:
    """The filters of a server list request (the caller's right to list every project is
    checked by the caller of this function).

    Raises:
        BadRequest: an unknown parameter (from 2.75), one Ferry cannot filter by, or a value
            that is not valid (a regular expression, time, boolean, number, sort key or direction).
        Forbidden: a member sorting by host or node, or listing ``status=DELETED``.
    """
    admin = view.ctx.is_admin
    usable: dict[str, list[str]] = {}
    for name, values in params.items():
        known = PARAMETERS.get(name)
        if known is None or not view.at_least(known[0]):
            if view.at_least(request.STRICT_QUERY):
                raise errors.BadRequest(f"Invalid input for query parameters {name}. "
                                        f"Additional properties are not allowed ('{name}' was unexpected)")
            continue
        members_from = known[1]
        if admin or (members_from is not None and view.at_least(members_from)):
            usable[name] = values
    for name in sorted(usable):
        if name in UNSUPPORTED:
            raise errors.BadRequest(f"Ferry does not filter servers by {name}.")

    def last(name: str) -> str | None:
        return request.last(usable, name)

    changes_since, changes_before = request.time_window(last("changes-since"), last("changes-before"))
    locked = last("locked")
    read_deleted = _read_deleted(last("deleted"), windowed=changes_since is not None or changes_before is not None)
    vm_states, task_states = _set(usable.get("vm_state")), _set(usable.get("task_state"))
    if "status" in usable:
        # As Nova: the status replaces vm_state, and task_state unless it stands for any task.
        vm_states, by_status = _states_of(view, frozenset(v.upper() for v in usable["status"]))
        if by_status is not None:
            task_states = by_status
        if vm_states == {states.DELETED}:  # deleted servers only, and for admins only
            if not admin:
                raise errors.Forbidden("Only administrators may list deleted instances")
            read_deleted = "only"
    budget = MatchBudget()
    return ServerFilters(
        name=_pattern("name", last("name"), budget),
        display_name=_pattern("display_name", last("display_name"), budget),
        hostname=_pattern("hostname", last("hostname"), budget),
        description=_pattern("display_description", last("display_description"), budget),
        read_deleted=read_deleted,
        all_tenants="all_tenants" in usable and request.parse_bool("all_tenants", last("all_tenants") or "true"),
        project_id=last("project_id") or last("tenant_id"),
        user_id=last("user_id"), host=last("host"), node=last("node"), uuid=last("uuid"),
        reservation_id=last("reservation_id"),
        flavor=last("flavor"), image=last("image") or last("image_ref"),
        availability_zone=last("availability_zone"), key_name=last("key_name"),
        vm_states=vm_states, task_states=task_states,
        power_states=_power_states(usable.get("power_state")),
        locked=None if locked is None else request.parse_bool("locked", locked),
        changes_since=changes_since, changes_before=changes_before,
        ip=_pattern("ip", last("ip"), budget), ip6=_pattern("ip6", last("ip6"), budget),
        tags=_tags(last("tags")), tags_any=_tags(last("tags-any")),
        not_tags=_tags(last("not-tags")), not_tags_any=_tags(last("not-tags-any")),
        sort=_sort(view, usable.get("sort_key") or [], usable.get("sort_dir") or [], admin=admin),
        limit=request.parse_limit(last("limit")), marker=last("marker"))


def _read_deleted(deleted: str | None, *, windowed: bool) -> ReadDeleted:
    """Which servers a list reads: an admin's ``deleted`` decides (Nova's true spellings ask for
    deleted servers, any other value for live ones); else a time window adds the deleted ones
    to the live ones."""
    if deleted is not None:
        return "only" if request.is_true(deleted) else "no"
    return "yes" if windowed else "no"


def _pattern(name: str, value: str | None, budget: MatchBudget) -> SearchPattern | None:
    return SearchPattern(name, value, budget) if value else None


# From this microversion a status Nova does not know is refused; before, it finds nothing.
INVALID_STATUS_REFUSED = "2.38"


def _states_of(view: ViewContext, statuses: frozenset[str]) -> tuple[frozenset[str], frozenset[str] | None]:
    """The vm_states and task_states a ``status`` filter selects (it replaces ``vm_state`` and
    ``task_state``, as in Nova: see :func:`ferry.compute.states.states_of_statuses`).

    Raises:
        BadRequest: from 2.38, no status is one Nova knows.
    """
    selected = states.states_of_statuses(statuses)
    if selected is None:
        if view.at_least(INVALID_STATUS_REFUSED):
            raise errors.BadRequest("Invalid status value")
        return frozenset(), None
    return selected


def _set(values: list[str] | None) -> frozenset[str] | None:
    found = frozenset(v for v in values or () if v)
    return found or None


def _power_states(values: list[str] | None) -> frozenset[int] | None:
    if not values:
        return None
    found = set()
    for value in values:
        try:
            found.add(int(value.strip(), 10))
        except ValueError as exc:
            raise errors.BadRequest(f"Invalid value '{value}' for power_state: expected a number.") from exc
    return frozenset(found)


def _tags(value: str | None) -> frozenset[str] | None:
    tags = frozenset(t.strip() for t in (value or "").split(",") if t.strip())
    return tags or None


def _ignored_sort_keys(view: ViewContext) -> frozenset[str]:
    """The sort keys Nova takes and ignores at the request's microversion."""
    if view.at_least(request.STRICT_QUERY):
        return frozenset()
    return IGNORED_SORT_KEYS - {"locked"} if view.at_least("2.73") else IGNORED_SORT_KEYS


def _sort(view: ViewContext, keys: list[str], directions: list[str], *,
          admin: bool) -> tuple[tuple[str, str], ...]:
    """``(key, direction)`` pairs, as Nova pairs them: ``created_at`` when directions come without
    keys; a key without a direction takes the first direction given (descending when none is).
    Keys Nova ignores at the microversion are left out (none from 2.75: Nova refuses them).

    Raises:
        BadRequest: a key Nova refuses or Ferry cannot sort by, an unknown direction, or more
            directions than keys.
        Forbidden: a member sorting by host or node.
    """
    if directions and not keys:
        keys = ["created_at"]
    if len(directions) > len(keys):
        raise errors.BadRequest("There are more sort directions than sort keys.")
    for direction in directions:
        if direction.lower() not in SORT_DIRECTIONS:
            raise errors.BadRequest(f"Invalid sort direction {direction!r}: use asc or desc.")
    default = directions[0].lower() if directions else "desc"
    pairs = []
    ignored = _ignored_sort_keys(view)
    for index, key in enumerate(keys):
        if key in ignored:
            continue
        if key not in SORT_KEYS:
            refused = "Ferry does not sort servers by" if key in NOVA_SORT_KEYS else "Invalid sort key"
            raise errors.BadRequest(f"{refused} {key}.")
        if key in ADMIN_SORT_KEYS and not admin:
            raise errors.Forbidden(f"Only administrators can sort servers by {key}.")
        pairs.append((key, directions[index].lower() if index < len(directions) else default))
    return tuple(pairs)
