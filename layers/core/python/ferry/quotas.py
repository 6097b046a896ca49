"""Per-project quotas on instances, cores and RAM (Nova's counting quotas).

A project's limit for a resource is the admin's override (``quotas`` table, set through
``PUT /os-quota-sets/{project_id}``) or the deployment default: Nova's defaults, changed with
``FERRY_QUOTA_INSTANCES``, ``FERRY_QUOTA_CORES`` and ``FERRY_QUOTA_RAM``. ``-1`` means
unlimited.

Usage is counted, not reserved: a project uses one instance and its flavor's vCPUs and
memory for every server it has that is not deleted — servers still waiting for a cell (build
requests) and servers in cell0 included. A server counts once, by its uuid, even while a move
between cells has a record of it in two cells: a visible record in the cell its undeleted
instance mapping names counts alone (the mapping is the authority on where a server lives);
a hidden one there (the switch hid it after the mapping was read) counts with the visible
copies in other cells, the larger of them, as does a visible copy of a server with no record
in its mapped cell. So the switch of a move between cells (the target cell's copy shown, the
mapping moved, the source cell's copy hidden, each a write of its own) counts the server once
at every moment, whatever order the cells are read in; a create or resize racing it is not
refused for a server counted twice. A build request whose instance is already written counts
once too, the larger of the two. A server in the middle of a resize counts the larger of its
old and new flavor for each resource, so a revert never needs quota of its own. This differs
from Nova on purpose: Nova counts the flavor the server has at the moment (or, counting from
placement, the allocations of both flavors) and checks quota again on a revert that grows.

A cell whose database does not answer (:func:`ferry.store.db.transient`) is left out of the
count, logged, as Nova leaves out a cell that does not respond: its servers count again once it
answers, and meanwhile a project may go over its limit by them.

Checks count the usage, add the request, and refuse what would go over a limit. Because two
requests can pass the same check concurrently, callers check again after writing their
records (with no further delta) and undo when the limit was crossed meanwhile.

Server groups (``server_groups`` per project, ``server_group_members`` per group and user) are
counted and enforced where groups are made and joined (:mod:`ferry.compute.server_groups`). The
other resources Nova lists (key pairs, metadata items, injected files) are shown with Nova's
defaults and can be set, but Ferry does not enforce them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from ferry import config, errors
from ferry.compute import states
from ferry.store import db
from ferry.store.api_models import BuildRequest, InstanceGroup, InstanceMapping, Quota
from ferry.store.cell_models import Instance
from ferry.store.db import all_cells, api_session, cell_session

INSTANCES = "instances"
CORES = "cores"
RAM = "ram"
COUNTED = (INSTANCES, CORES, RAM)
# Server groups per project, and servers per group and user (ferry.compute.server_groups).
SERVER_GROUPS = "server_groups"
SERVER_GROUP_MEMBERS = "server_group_members"

UNLIMITED = -1

# Nova's defaults; the counted ones can be changed through the environment.
NOVA_DEFAULTS: dict[str, int] = {
    CORES: 20,
    INSTANCES: 10,
    RAM: 51200,
    "key_pairs": 100,
    "metadata_items": 128,
    SERVER_GROUPS: 10,
    SERVER_GROUP_MEMBERS: 10,
    "injected_files": 5,
    "injected_file_content_bytes": 10240,
    "injected_file_path_bytes": 255,
}
RESOURCES = tuple(NOVA_DEFAULTS)
# Resources the quota-set API stops showing at 2.57 (personality files went away).
INJECTED_FILE_RESOURCES = ("injected_files", "injected_file_content_bytes", "injected_file_path_bytes")

_ENV = dict(zip((INSTANCES, CORES, RAM), config.QUOTA_VARIABLES, strict=True))

# task_states of a server whose move holds both flavors.
_MOVING_TASK_STATES = frozenset({states.RESIZE_PREP, states.RESIZE_MIGRATING, states.RESIZE_MIGRATED,
                                 states.RESIZE_FINISH, states.RESIZE_REVERTING, states.RESIZE_CONFIRMING})


def defaults() -> dict[str, int]:
    """The limits of a project without overrides.

    Raises:
        InvalidQuotaDefault: a ``FERRY_QUOTA_*`` variable is not an integer of at least -1.
    """
    values = dict(NOVA_DEFAULTS)
    configured = config.get().quota_defaults
    for resource, variable in _ENV.items():
        raw = configured.get(variable)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError as exc:
            raise errors.InvalidQuotaDefault(f"{variable} must be an integer, not {raw!r}.") from exc
        if value < UNLIMITED:
            raise errors.InvalidQuotaDefault(f"{variable} must be -1 (unlimited) or more, not {value}.")
        values[resource] = value
    return values


def limits(project_id: str, session: Session | None = None) -> dict[str, int]:
    """The project's limit for every resource (overrides over defaults); read in ``session`` when
    given (a caller inside a write transaction of its own), else in a session of its own."""
    values = defaults()
    if session is None:
        with api_session() as own:
            return limits(project_id, own)
    for row in session.scalars(select(Quota).where(Quota.project_id == project_id)):
        if row.resource in values:
            values[row.resource] = row.hard_limit
    return values


def _flavor_usage(flavor: Mapping[str, object] | None) -> tuple[int, int]:
    if not flavor:
        return 0, 0
    return int(flavor.get("vcpus") or 0), int(flavor.get("memory_mb") or 0)  # type: ignore[call-overload]


def instance_usage(instance: Instance) -> tuple[int, int]:
    """The (cores, ram) a server counts: the larger of old and new flavor while it is moving."""
    cores, ram = _flavor_usage(instance.flavor)
    moving = instance.vm_state == states.RESIZED or instance.task_state in _MOVING_TASK_STATES
    if moving:
        for other in (instance.old_flavor, instance.new_flavor):
            other_cores, other_ram = _flavor_usage(other)
            cores, ram = max(cores, other_cores), max(ram, other_ram)
    return cores, ram


def server_groups_used(project_id: str, session: Session | None = None) -> int:
    """How many server groups the project has (in ``session`` when given)."""
    if session is None:
        with api_session() as own:
            return server_groups_used(project_id, own)
    return session.scalar(select(func.count(InstanceGroup.id)).where(InstanceGroup.project_id == project_id)) or 0


def usage(project_id: str) -> dict[str, int]:
    """What the project's servers use now: ``{"instances", "cores", "ram"}``, each server once (see the module)."""
    # {uuid: (cores, ram)}; a server found in several places that count (a build request whose
    # instance is being written, a hidden record in its mapped cell and a visible copy elsewhere,
    # visible copies of a server whose mapped cell has no record) counts the largest of them.
    servers: dict[str, tuple[int, int]] = {}
    with api_session() as session:
        # Mappings queued for delete stay (they are never purged): leave them out, not load them all.
        home = {uuid: cell_id for uuid, cell_id in session.execute(
            select(InstanceMapping.instance_uuid, InstanceMapping.cell_id).where(
                InstanceMapping.project_id == project_id, InstanceMapping.queued_for_delete.is_(False)))}
        unscheduled = [uuid for uuid, cell_id in home.items() if cell_id is None]
        if unscheduled:
            for build in session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid.in_(unscheduled))):
                servers[build.instance_uuid] = _flavor_usage(build.instance.get("flavor"))
    at_home: set[str] = set()  # servers counted by a visible record in their mapped cell
    for cell in all_cells():
        try:
            with cell_session(cell) as session:
                records = list(session.scalars(select(Instance).where(
                    Instance.project_id == project_id, Instance.deleted.is_(False))))
        except DBAPIError as exc:
            # As Nova counts: a cell that does not answer is left out (its servers are not
            # counted until it answers again), rather than every boot and upsize failing.
            db.left_out(exc, cell, "servers (quota usage)", project_id=project_id)
            continue
        for instance in records:
            counted = instance_usage(instance)
            mapped_here = home.get(instance.uuid) == cell.id
            if mapped_here and not instance.hidden:
                servers[instance.uuid] = counted
                at_home.add(instance.uuid)
            elif (mapped_here or not instance.hidden) and instance.uuid not in at_home:
                cores, ram = servers.get(instance.uuid, (0, 0))
                servers[instance.uuid] = (max(cores, counted[0]), max(ram, counted[1]))
    return {INSTANCES: len(servers), CORES: sum(cores for cores, _ in servers.values()),
            RAM: sum(ram for _, ram in servers.values())}


@dataclass(frozen=True)
class Headroom:
    """One resource's limit and use at the time of a check."""

    resource: str
    limit: int
    used: int
    requested: int

    @property
    def over(self) -> bool:
        return self.limit != UNLIMITED and self.used + self.requested > self.limit


def over_quota_message(overs: Iterable[Headroom]) -> str:
    """Nova's message: ``Quota exceeded for cores: Requested 4, but already used 18 of 20 cores``."""
    items = sorted(overs, key=lambda h: h.resource)

    def joined(values: Iterable[object]) -> str:
        return ", ".join(str(v) for v in values)

    names = joined(h.resource for h in items)
    return (f"Quota exceeded for {names}: Requested {joined(h.requested for h in items)}, "
            f"but already used {joined(h.used for h in items)} of {joined(h.limit for h in items)} {names}")


def _overs(project_id: str, wanted: Mapping[str, int]) -> list[Headroom]:
    project_limits = limits(project_id)
    if all(project_limits[r] == UNLIMITED for r in wanted):
        return []
    used = usage(project_id)
    return [h for h in (Headroom(r, project_limits[r], used[r], n) for r, n in wanted.items()) if h.over]


def check(project_id: str, deltas: Mapping[str, int]) -> None:
    """Refuse a request that would take the project over a limit.

    Params:
        deltas: what the request adds, per counted resource (zero or negative entries are
            not checked: a request that frees a resource never fails on it).

    Raises:
        OverQuota: some requested resource would exceed its limit (403 with Nova's message).
    """
    wanted = {r: int(deltas[r]) for r in COUNTED if int(deltas.get(r, 0)) > 0}
    if not wanted:
        return
    overs = _overs(project_id, wanted)
    if overs:
        raise errors.OverQuota(over_quota_message(overs), project_id=project_id)


def servers_that_fit(project_id: str, each: Mapping[str, int], minimum: int, maximum: int) -> int:
    """How many servers asking ``each`` (per counted resource) the project has room for, from
    ``minimum`` up to ``maximum`` (Nova's multiple create: as many as fit, at least the minimum).

    Raises:
        OverQuota: not even ``minimum`` fit (the message names what ``minimum`` servers ask).
    """
    wanted = {r: int(each[r]) for r in COUNTED if int(each.get(r, 0)) > 0}
    project_limits = limits(project_id)
    bounded = [r for r in wanted if project_limits[r] != UNLIMITED]
    if not bounded:
        return maximum
    used = usage(project_id)
    fit = min([maximum, *((project_limits[r] - used[r]) // wanted[r] for r in bounded)])
    if fit < minimum:
        overs = [h for h in (Headroom(r, project_limits[r], used[r], wanted[r] * minimum) for r in bounded) if h.over]
        raise errors.OverQuota(over_quota_message(overs), project_id=project_id)
    return fit


def recheck(project_id: str, deltas: Mapping[str, int]) -> None:
    """After writing what ``deltas`` asked for: refuse when a concurrent request took the room.

    The records written already count, so this checks the same resources with nothing more
    requested; the message still names what the request asked for.

    Raises:
        OverQuota: a requested resource is now over its limit (the caller undoes its writes).
    """
    wanted = {r: int(deltas[r]) for r in COUNTED if int(deltas.get(r, 0)) > 0}
    if not wanted:
        return
    overs = _overs(project_id, dict.fromkeys(wanted, 0))
    if overs:
        shown = [Headroom(h.resource, h.limit, h.used - wanted[h.resource], wanted[h.resource]) for h in overs]
        raise errors.OverQuota(over_quota_message(shown), project_id=project_id)


def update(project_id: str, values: Mapping[str, int], *, force: bool = False) -> dict[str, int]:
    """Set limits for a project; returns its limits afterwards.

    Params:
        values: resource → limit (``-1`` unlimited); unknown resources are refused.
        force: allow a counted limit (instances, cores, RAM, server groups) below what the
            project uses now (Nova's ``force``).

    Raises:
        BadRequest: an unknown resource, a limit below -1, or (without ``force``) a counted
            limit below the current usage.

    A first limit of a resource that a concurrent request set meanwhile is updated (written again once).
    """
    unknown = sorted(set(values) - set(RESOURCES))
    if unknown:
        raise errors.BadRequest(f"Bad key(s) {', '.join(unknown)} in quota_set")
    for resource, limit in values.items():
        if int(limit) < UNLIMITED:
            raise errors.BadRequest(f"Quota limit {limit} for {resource} must be -1 or greater.")
    checked = (*COUNTED, SERVER_GROUPS)
    if not force and any(r in values and int(values[r]) != UNLIMITED for r in checked):
        used = {**(usage(project_id) if any(r in values for r in COUNTED) else {}),
                **({SERVER_GROUPS: server_groups_used(project_id)} if SERVER_GROUPS in values else {})}
        for resource in checked:
            wanted = values.get(resource)
            if wanted is not None and int(wanted) != UNLIMITED and int(wanted) < used[resource]:
                raise errors.BadRequest(f"Quota limit {wanted} for {resource} must be greater than or equal to "
                                        f"already used and reserved {used[resource]}.")
    try:
        _write_limits(project_id, values)
    except IntegrityError:
        # A concurrent request set a first limit of one of these resources between the read and the
        # insert (the unique project and resource): run again, which finds its row and updates it.
        _write_limits(project_id, values)
    return limits(project_id)


def _write_limits(project_id: str, values: Mapping[str, int]) -> None:
    """Update the project's rows of these resources, and add the missing ones, in one transaction.

    Raises:
        IntegrityError: a row added meanwhile by another transaction (nothing is written).
    """
    with api_session() as session:
        existing = {row.resource: row for row in session.scalars(select(Quota).where(Quota.project_id == project_id))}
        for resource, limit in values.items():
            row = existing.get(resource)
            if row is None:
                session.add(Quota(project_id=project_id, resource=resource, hard_limit=int(limit)))
            else:
                row.hard_limit = int(limit)


def reset(project_id: str) -> None:
    """Drop a project's overrides (it gets the defaults again)."""
    with api_session() as session:
        for row in session.scalars(select(Quota).where(Quota.project_id == project_id)):
            session.delete(row)
