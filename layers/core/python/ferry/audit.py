"""The invariant checker behind ``ferry audit``: does what the store says match what exists?

:func:`run_audit` reads the API database, every cell, placement, the image bucket, the running
workflows and what each host agent last reported (its guests and instance directories, see
:func:`ferry.hosts.host_view`), and returns an :class:`AuditReport`: one :class:`Problem` per
broken invariant, each with a kind code, the resource, a message, and whether ``--fix`` can
repair it. ``docs/reliability.md`` lists the invariants and a runbook entry for every kind.

The audit runs beside live workflows, so it only judges what has settled:

- a server with a task, or whose migration is under way, is not compared with placement,
  its ports or its hosts (only checked for being stuck);
- records changed within ``grace_seconds`` are left for the next run (a workflow may be between
  two of its writes);
- a host's report is only trusted about a server when it was sent after the server's and its
  migrations' last change (minus ``clock_skew_seconds``).

Repairs (``fix=True``) only remove what nothing owns or put a stuck record into ``error``; each
one re-checks what it changes (placement consumer generation, migration status, the hidden copy's
row and its cell's migrations, the binding's or attachment's columns and the server's moves, the
volume's status, that snapshot extents still have no image object) and refuses when it changed
meanwhile. A stuck migration is only put in error when every move state machine's executions
were listed and, listed again just before the repair, still show none for its server. After
repairing, the audit runs again and reports what is left.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import ColumnElement, CursorResult, delete, func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import InstrumentedAttribute, Session

from ferry import aws, config, errors, hosts, images, network, placement, protocol, volumes
from ferry.compute import actions, instances, migration_states, states
from ferry.observability import logger
from ferry.store.api_models import (
    Allocation,
    BuildRequest,
    CellMapping,
    Consumer,
    InstanceMapping,
    Inventory,
    Port,
    PortBinding,
    ResourceProvider,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration, Service
from ferry.store.db import api_session, cell_session

# --- problem kinds (each has a runbook entry in docs/reliability.md) -----------------------------

INSTANCE_NOT_VISIBLE = "instance_not_visible"
INSTANCE_MAPPING_MISMATCH = "instance_mapping_mismatch"
INSTANCE_UNMAPPED = "instance_unmapped"
HIDDEN_COPY_STALE = "hidden_copy_stale"
ALLOCATION_ORPHAN = "allocation_orphan"
ALLOCATION_MISSING = "allocation_missing"
ALLOCATION_MISMATCH = "allocation_mismatch"
MIGRATION_ALLOCATION_HELD = "migration_allocation_held"
PROVIDER_OVER_CAPACITY = "provider_over_capacity"
INVENTORY_USAGE_DRIFT = "inventory_usage_drift"
GUEST_ORPHAN = "guest_orphan"
GUEST_MISSING = "guest_missing"
INSTANCE_DIR_ORPHAN = "instance_dir_orphan"
PORT_BINDING_ORPHAN = "port_binding_orphan"
PORT_BINDING_MISSING = "port_binding_missing"
VOLUME_ATTACHMENT_ORPHAN = "volume_attachment_orphan"
VOLUME_LEFT_DELETING = "volume_left_deleting"
VOLUME_OPERATION_LEFT = "volume_operation_left"
SNAPSHOT_IMAGE_ORPHAN = "snapshot_image_orphan"
SNAPSHOT_DATA_ORPHAN = "snapshot_data_orphan"
TRANSFER_ORPHAN = "transfer_orphan"
MIGRATION_STATE_MISMATCH = "migration_state_mismatch"
# How long the repairs of stuck migrations share one listing of the running workflows.
RELIST_SECONDS = 10.0

MIGRATION_STUCK = "migration_stuck"
INSTANCE_TASK_STUCK = "instance_task_stuck"
BUILD_REQUEST_STUCK = "build_request_stuck"

# One line of what to do; docs/reliability.md has the whole runbook entry under the kind's name.
HINTS: dict[str, str] = {
    INSTANCE_NOT_VISIBLE: "find the server's copies in the cells and point the instance mapping at the right one",
    INSTANCE_MAPPING_MISMATCH: "decide which cell holds the server, hide or remove the other copy, fix the mapping",
    INSTANCE_UNMAPPED: "create the instance mapping for the cell that holds the server, or delete the record",
    HIDDEN_COPY_STALE: "ferry audit --fix hard-deletes it",
    ALLOCATION_ORPHAN: "ferry audit --fix deletes it",
    ALLOCATION_MISSING: "re-create the server's allocation on its host with its flavor",
    ALLOCATION_MISMATCH: "set the consumer's allocation to its flavor on its host",
    MIGRATION_ALLOCATION_HELD: "confirm or revert the move again, or delete the allocation once the source is clean",
    PROVIDER_OVER_CAPACITY: "move servers off the host or correct the inventory the agent reports",
    INVENTORY_USAGE_DRIFT: "ferry audit --fix recomputes the counter from the allocations",
    GUEST_ORPHAN: "check the guest on the host, then destroy and undefine it",
    GUEST_MISSING: "the server has no guest on its host: rebuild it or restore its disks, then reset its state",
    INSTANCE_DIR_ORPHAN: "check the directory on the host, then remove it",
    PORT_BINDING_ORPHAN: "ferry audit --fix deletes the binding",
    PORT_BINDING_MISSING: "bind the port to the server's host again (ACTIVE)",
    VOLUME_ATTACHMENT_ORPHAN: "ferry audit --fix deletes the attachment",
    VOLUME_LEFT_DELETING: "remove what is at the volume's path, then run ferry volume forget <id>",
    VOLUME_OPERATION_LEFT: "ferry audit --fix puts the volume back as its server's records say; else see the runbook",
    SNAPSHOT_IMAGE_ORPHAN: "ferry audit --fix deletes Ferry's own snapshots; check and delete any other by hand",
    SNAPSHOT_DATA_ORPHAN: "ferry audit --fix deletes the extents of a known move's snapshot; check any other by hand",
    TRANSFER_ORPHAN: "ferry audit --fix deletes the objects",
    MIGRATION_STATE_MISMATCH: "ferry audit --fix puts the migration in error",
    MIGRATION_STUCK: "ferry audit --fix puts it in error, and its action's open events, once no workflow runs "
                     "for it (a confirm that never began goes back to finished)",
    INSTANCE_TASK_STUCK: "read the server's last action and execution, then reset its state",
    BUILD_REQUEST_STUCK: "delete the server, then run ferry audit --fix for the claim it held",
}

KINDS = tuple(HINTS)

# Migration statuses by what they mean for the records around them.
FORWARD = (migration_states.PRE_MIGRATING, migration_states.MIGRATING, migration_states.POST_MIGRATING)
SETTLING = (migration_states.CONFIRMING, migration_states.REVERTING)
IN_FLIGHT = FORWARD + SETTLING
OPEN = IN_FLIGHT + (migration_states.FINISHED,)

# vm_states of a server that has a guest and an allocation on its host.
SETTLED_VM_STATES = (states.ACTIVE, states.STOPPED, states.RESIZED, states.SUSPENDED, states.PAUSED)

# Volume statuses an orphan attachment's repair may make ``available`` once nothing holds the volume
# (Cinder's; ``deleting`` never: the volume's file may already be gone). A ``reserved`` one, a boot's
# root volume, is released as the boot's own undo does instead (:func:`_release_reserved`).
HELD_VOLUME_STATUSES = (volumes.IN_USE, volumes.ATTACHING, volumes.DETACHING, volumes.ERROR_DETACHING)
# Volume statuses only an attach or detach under way may leave a volume in, or one that failed after its
# host detached the volume (``error_detaching``: FailVolumeOperation could not update the records).
OPERATING_VOLUME_STATUSES = (volumes.ATTACHING, volumes.DETACHING, volumes.ERROR_DETACHING)

SNAPSHOT_SUFFIX = "-resize-temp"

DEFAULT_GRACE_SECONDS = 120.0
DEFAULT_CLOCK_SKEW_SECONDS = 5.0


@dataclass(frozen=True)
class Problem:
    """One broken invariant.

    ``kind`` is the code (one of :data:`KINDS`), ``resource`` names what is wrong
    (``instance/<uuid>``, ``allocation/<consumer>@<provider>``, ``host/<host>/dir/<name>``, …),
    ``message`` says it in words, ``fixable`` whether ``--fix`` repairs it.
    """

    kind: str
    resource: str
    message: str
    repair: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    @property
    def fixable(self) -> bool:
        return self.repair is not None

    @property
    def hint(self) -> str:
        return HINTS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "resource": self.resource, "message": self.message, "fixable": self.fixable,
                "hint": self.hint}


@dataclass(frozen=True)
class Repair:
    """What ``--fix`` did about a problem: ``action`` on success, ``error`` when the repair failed."""

    problem: Problem
    action: str | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.problem.kind, "resource": self.problem.resource, "action": self.action,
                "error": self.error}


@dataclass
class AuditReport:
    """The outcome of an audit: the problems left, the repairs made, and checks that could not run."""

    problems: list[Problem] = field(default_factory=list)
    repairs: list[Repair] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def kinds(self) -> list[str]:
        """The kinds of the problems left, sorted, one per problem."""
        return sorted(p.kind for p in self.problems)

    def of_kind(self, kind: str) -> list[Problem]:
        return [p for p in self.problems if p.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {"clean": self.clean, "problems": [p.to_dict() for p in self.problems],
                "repairs": [r.to_dict() for r in self.repairs], "skipped": list(self.skipped)}

    def describe(self) -> str:
        """The report as lines of text (what ``ferry audit`` prints)."""
        lines = []
        for repair in self.repairs:
            if repair.error is None:
                lines.append(f"FIXED    {repair.problem.kind} {repair.problem.resource}: {repair.action}")
            else:
                lines.append(f"NOT FIXED {repair.problem.kind} {repair.problem.resource}: {repair.error}")
        for problem in self.problems:
            tag = "FIXABLE " if problem.fixable else "PROBLEM "
            lines.append(f"{tag} {problem.kind} {problem.resource}: {problem.message} (what to do: {problem.hint})")
        for note in self.skipped:
            lines.append(f"SKIPPED  {note}")
        lines.append("clean" if self.clean else f"{len(self.problems)} problem(s)")
        return "\n".join(lines)


# --- what the audit reads -----------------------------------------------------------------------


@dataclass
class _Copy:
    """An instance row as found in one cell."""

    cell: str
    row: Instance


@dataclass
class _HostView:
    host: str
    cell: str
    sent_at: dt.datetime
    guests: set[str]
    instance_dirs: set[str] | None


@dataclass
class _World:
    now: dt.datetime
    grace: dt.timedelta
    skew: dt.timedelta
    cell_names: dict[int, str]
    mappings: dict[str, InstanceMapping]
    build_requests: set[str]
    copies: dict[str, list[_Copy]]
    # Every copy of every migration (a cross-cell move has one per cell), by uuid.
    migration_copies: dict[str, list[tuple[str, Migration]]]
    bfv: set[tuple[str, str]]
    views: dict[str, _HostView]
    providers: dict[str, ResourceProvider]
    inventories: dict[tuple[int, str], Inventory]
    # Each inventory's used counter and what its allocations add up to, by inventory id, read in
    # one statement: a claim writes both in one transaction, so they differ only if they drifted.
    usage: dict[int, tuple[int, int]]
    allocations: dict[str, dict[str, dict[str, int]]]
    consumers: dict[str, Consumer]
    ports: list[Port]
    attachments: list[VolumeAttachment]
    # Volumes a server was deleted with whose file no host removed (status ``deleting``).
    left_deleting: list[Volume]
    # Volumes being attached or detached, or whose detach failed (status ``attaching``, ``detaching``,
    # ``error_detaching``), with their attachments.
    operating: list[Volume]
    # Volumes a boot reserved (status ``reserved``), with their attachments.
    reserved: list[Volume]
    # The volumes build requests name (a boot not handed to a cell yet owns them).
    build_volumes: set[str]
    # The server each root volume a boot made from an image was made for, by volume id.
    made_for: dict[str, str]
    # ``(instance uuid, volume id)`` of every live block device mapping of a volume, in any cell.
    volume_mappings: set[tuple[str, str]]
    volume_statuses: dict[str, str]
    # Names of the running workflow executions; None when they cannot be listed.
    running: set[str] | None
    # The move state machines (resize, confirm, revert) whose executions ``running`` leaves out.
    unlisted: list[str]
    # Whether ``running`` leaves out the boot's executions (its state machine is not configured).
    boots_unlisted: bool = False
    # Lists the running executions again, as ``running`` was, with why it could not (None then).
    relist: Callable[[], tuple[set[str] | None, str]] = lambda: (None, "no way to list them was given")
    # The last listing ``relist`` made, and when (monotonic): repairs close together share it.
    relisted: tuple[set[str], float] | None = None

    def running_now(self) -> tuple[set[str] | None, str]:
        """The running executions as the repairs see them; None, and why, when they cannot be
        listed. A listing is shared by the repairs of the next :data:`RELIST_SECONDS`; one that
        failed is not, so the next repair asks again."""
        if self.relisted is not None and time.monotonic() - self.relisted[1] < RELIST_SECONDS:
            return self.relisted[0], ""
        running, why = self.relist()
        if running is not None:
            self.relisted = running, time.monotonic()
        return running, why
    migrations: dict[str, Migration] = field(default_factory=dict)
    migrations_of: dict[str, list[Migration]] = field(default_factory=dict)

    # -- derived views

    def mapped_cell(self, uuid: str) -> str | None:
        mapping = self.mappings.get(uuid)
        if mapping is None or mapping.cell_id is None or mapping.queued_for_delete:
            return None
        return self.cell_names.get(mapping.cell_id)

    def visible(self, uuid: str) -> Instance | None:
        """The server's visible, not deleted copy in the cell its mapping names."""
        cell = self.mapped_cell(uuid)
        for copy in self.copies.get(uuid, []):
            if copy.cell == cell and not copy.row.hidden and not copy.row.deleted:
                return copy.row
        return None

    def exists(self, uuid: str) -> bool:
        """Whether the server exists (a live copy anywhere, or a build request)."""
        return uuid in self.build_requests or any(not c.row.deleted for c in self.copies.get(uuid, []))

    def open_migrations(self, uuid: str) -> list[Migration]:
        return [m for m in self.migrations_of.get(uuid, []) if m.status in OPEN]

    def unsettled_migrations(self, uuid: str) -> list[Migration]:
        """Open migrations, and failed ones still holding their allocation (a confirm that failed at the source)."""
        return [m for m in self.migrations_of.get(uuid, [])
                if m.status in OPEN or (m.status == migration_states.ERROR and m.uuid in self.allocations)]

    def in_flight(self, uuid: str) -> bool:
        """Whether a workflow may be changing the server now: a task, or a migration under way."""
        instance = self.visible(uuid)
        if instance is not None and instance.task_state is not None:
            return True
        return any(m.status in IN_FLIGHT for m in self.migrations_of.get(uuid, []))

    def settled(self, uuid: str) -> Instance | None:
        """The visible copy of a server that has settled in a state with a guest and an allocation."""
        instance = self.visible(uuid)
        if instance is None or instance.vm_state not in SETTLED_VM_STATES or self.in_flight(uuid):
            return None
        return instance

    def last_change(self, uuid: str) -> dt.datetime:
        """The newest write to any copy of the server or of its migrations."""
        moments: list[dt.datetime | None] = [dt.datetime.min]
        for copy in self.copies.get(uuid, []):
            moments += [copy.row.created_at, copy.row.updated_at, copy.row.deleted_at]
        for copies in (self.migration_copies.get(m.uuid, []) for m in self.migrations_of.get(uuid, [])):
            for _cell, migration in copies:
                moments += [migration.created_at, migration.updated_at]
        mapping = self.mappings.get(uuid)
        if mapping is not None:
            moments += [mapping.created_at, mapping.updated_at]
        return max(m for m in moments if m is not None)

    def recent(self, moment: dt.datetime | None) -> bool:
        """Whether ``moment`` is within the grace period (a workflow may not have finished its writes)."""
        return moment is not None and self.now - moment < self.grace

    def report_covers(self, view: _HostView, uuid: str) -> bool:
        """Whether ``view`` was sent after the server's last change, so it shows the result of that change."""
        return view.sent_at - self.skew > self.last_change(uuid)

    def live(self, uuid: str) -> bool | None:
        """Whether a workflow execution about the server runs (None when that cannot be told)."""
        if self.running is None:
            return None
        return any(uuid in name for name in self.running)

    def provider_for(self, node: str | None, host: str | None) -> ResourceProvider | None:
        by_name = {p.name: p for p in self.providers.values()}
        if node and node in by_name:
            return by_name[node]
        return next((p for p in self.providers.values() if p.host == host), None) if host else None

    def is_bfv(self, cell: str, uuid: str) -> bool:
        return (cell, uuid) in self.bfv

    def seen_migrations(self, uuid: str) -> set[tuple[str, str]]:
        """``(migration uuid, status)`` of every copy of the server's migrations, as read."""
        return {(m.uuid, m.status) for chosen in self.migrations_of.get(uuid, [])
                for _cell, m in self.migration_copies.get(chosen.uuid, [])}


def _changed(row: Any) -> dt.datetime:
    return cast(dt.datetime, row.updated_at or row.created_at)


def _read_world(grace_seconds: float, clock_skew_seconds: float, running: Collection[str] | None,
                skipped: list[str]) -> _World:
    now = utcnow()
    # Listed before the records are read: a workflow that ends meanwhile leaves settled records, and
    # one that starts meanwhile writes records newer than the grace period allows to judge.
    running_names = set(running) if running is not None else _running_executions(skipped)
    unlisted = _unlisted_move_machines() if running is None and running_names is not None else []
    if unlisted:
        skipped.append(f"the {', '.join(unlisted)} state machine ARN(s) are not configured: whether a move still "
                       f"runs cannot be told, so stuck migrations are reported but not repaired")
    with api_session() as session:
        cells = list(session.scalars(select(CellMapping).order_by(CellMapping.id)))
        mappings = {m.instance_uuid: m for m in session.scalars(select(InstanceMapping))}
        build_requests = set(session.scalars(select(BuildRequest.instance_uuid)))
        providers = {p.uuid: p for p in session.scalars(select(ResourceProvider))}
        inventories = {(i.resource_provider_id, i.resource_class): i for i in session.scalars(select(Inventory))}
        usage = {inventory_id: (int(used), int(allocated)) for inventory_id, used, allocated in session.execute(
            select(Inventory.id, Inventory.used, _allocated_sum()))}
        consumers = {c.uuid: c for c in session.scalars(select(Consumer))}
        allocations: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
        rp_uuid = {p.id: p.uuid for p in providers.values()}
        for alloc in session.scalars(select(Allocation)):
            allocations[alloc.consumer_uuid][rp_uuid[alloc.resource_provider_id]][alloc.resource_class] = alloc.used
        ports = list(session.scalars(select(Port)))
        attachments = list(session.scalars(select(VolumeAttachment)))
        left_deleting = list(session.scalars(select(Volume).where(Volume.status == volumes.DELETING)))
        operating = list(session.scalars(select(Volume).where(Volume.status.in_(OPERATING_VOLUME_STATUSES))))
        reserved = list(session.scalars(select(Volume).where(Volume.status == volumes.RESERVED)))
        build_volumes = _volumes_named_by_builds(session)
        made_for = _servers_volumes_were_made_for(session)
        volume_statuses = {volume_id: status for volume_id, status in session.execute(select(Volume.id, Volume.status))}
    copies: dict[str, list[_Copy]] = defaultdict(list)
    migration_copies: dict[str, list[tuple[str, Migration]]] = defaultdict(list)
    bfv: set[tuple[str, str]] = set()
    volume_mappings: set[tuple[str, str | None]] = set()
    views: dict[str, _HostView] = {}
    for cell in cells:
        with cell_session(cell) as session:
            for row in session.scalars(select(Instance)):
                copies[row.uuid].append(_Copy(cell.name, row))
            for migration in session.scalars(select(Migration).where(Migration.deleted.is_(False))):
                migration_copies[migration.uuid].append((cell.name, migration))
            bfv.update((cell.name, uuid) for uuid in session.scalars(select(BlockDeviceMapping.instance_uuid).where(
                BlockDeviceMapping.deleted.is_(False), BlockDeviceMapping.boot_index == 0,
                BlockDeviceMapping.destination_type == "volume")))
            volume_mappings.update((uuid, volume_id) for uuid, volume_id in session.execute(
                select(BlockDeviceMapping.instance_uuid, BlockDeviceMapping.volume_id).where(
                    BlockDeviceMapping.deleted.is_(False), BlockDeviceMapping.volume_id.is_not(None))))
            for service in session.scalars(select(Service)):
                view = _parse_view(service, cell.name, skipped)
                if view is not None:
                    views[service.host] = view
    world = _World(
        now=now, grace=dt.timedelta(seconds=grace_seconds), skew=dt.timedelta(seconds=clock_skew_seconds),
        cell_names={c.id: c.name for c in cells}, mappings=mappings, build_requests=build_requests,
        copies=dict(copies), migration_copies=dict(migration_copies), bfv=bfv, views=views, providers=providers,
        inventories=inventories, usage=usage, allocations={c: dict(a) for c, a in allocations.items()},
        consumers=consumers,
        ports=ports, attachments=attachments, left_deleting=left_deleting, operating=operating, reserved=reserved,
        build_volumes=build_volumes, made_for=made_for,
        volume_mappings={(u, v) for u, v in volume_mappings if v is not None}, volume_statuses=volume_statuses,
        running=running_names, unlisted=unlisted,
        boots_unlisted=running is None and not config.get().boot_state_machine_arn,
        relist=(lambda: (set(running), "")) if running is not None else _list_running_again,
    )
    # One record per migration: the copy in the cell the server is mapped to wins (as GET /os-migrations).
    for migration_uuid, found in world.migration_copies.items():
        mapped = world.mapped_cell(found[0][1].instance_uuid)
        chosen = next((m for cell, m in found if cell == mapped), found[0][1])
        world.migrations[migration_uuid] = chosen
        world.migrations_of.setdefault(chosen.instance_uuid, []).append(chosen)
    for found_migrations in world.migrations_of.values():
        found_migrations.sort(key=lambda m: (m.created_at, m.id))
    return world


def _volumes_named_by_builds(session: Session) -> set[str]:
    """The volumes the build requests' block device mappings name (servers not built yet)."""
    return {str(bdm["volume_id"]) for bdms in session.scalars(select(BuildRequest.block_device_mappings))
            for bdm in bdms or [] if isinstance(bdm, dict) and bdm.get("volume_id")}


def _servers_volumes_were_made_for(session: Session) -> dict[str, str]:
    """``{volume id: server uuid}`` of the root volumes boots made from an image.

    Only a boot makes a volume from an image (``ferry volume register`` records none with an image), and
    names it ``<server uuid>-root``; names never change. Such a volume outlives its server when the server
    ran and its owner kept it, and may be reserved by another server's boot later: it is that server's
    existing volume then, not one made for it.
    """
    suffix = volumes.ROOT_VOLUME_SUFFIX
    made = session.execute(select(Volume.id, Volume.name).where(Volume.image_id.is_not(None)))
    return {volume_id: name.removesuffix(suffix) for volume_id, name in made if name and name.endswith(suffix)}


def _parse_view(service: Service, cell: str, skipped: list[str]) -> _HostView | None:
    view = hosts.host_view(service)
    if view is None:
        return None
    try:
        sent_at = hosts.report_time(view["sent_at"])
    except (KeyError, TypeError, ValueError):
        skipped.append(f"host {service.host}: its last report has no readable sent_at; its guests were not checked")
        return None
    dirs = view.get("instance_dirs")
    return _HostView(service.host, cell, sent_at, set(view.get("guests") or []),
                     set(dirs) if dirs is not None else None)


def _running_executions(skipped: list[str]) -> set[str] | None:
    """Names of every running execution of Ferry's state machines; None when they cannot be listed."""
    settings = config.get()
    arns = [arn for arn in (settings.boot_state_machine_arn, settings.delete_state_machine_arn,
                            settings.power_state_machine_arn, settings.resize_state_machine_arn,
                            settings.confirm_resize_state_machine_arn, settings.revert_resize_state_machine_arn,
                            settings.volume_attachment_state_machine_arn) if arn]
    if not arns:
        skipped.append("no state machine is configured: whether a workflow still runs cannot be told, "
                       "so stuck migrations are reported but not repaired")
        return None
    names: set[str] = set()
    try:
        sfn = aws.client("stepfunctions")
        for arn in arns:
            for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=arn, statusFilter="RUNNING"):
                names.update(e["name"] for e in page.get("executions", []))
    except (ClientError, BotoCoreError) as exc:
        skipped.append(f"listing running workflows failed ({exc}): stuck migrations are reported but not repaired")
        return None
    return names


def _list_running_again() -> tuple[set[str] | None, str]:
    """:func:`_running_executions` for a repair's last look: the names, or None and why not."""
    why: list[str] = []
    return _running_executions(why), "; ".join(why)


def _unlisted_move_machines() -> list[str]:
    """The move state machines with no ARN configured: a move of theirs running is not listed."""
    settings = config.get()
    machines = {"resize": settings.resize_state_machine_arn,
                "confirm resize": settings.confirm_resize_state_machine_arn,
                "revert resize": settings.revert_resize_state_machine_arn}
    return [name for name, arn in machines.items() if not arn]


# --- the checks ---------------------------------------------------------------------------------


def _check_instances(world: _World) -> Iterable[Problem]:
    """Exactly one visible copy, in the mapped cell; hidden copies only while a move between cells explains them."""
    for uuid in sorted(set(world.mappings) | set(world.copies)):
        mapping = world.mappings.get(uuid)
        copies = world.copies.get(uuid, [])
        live = [c for c in copies if not c.row.hidden and not c.row.deleted]
        if world.recent(world.last_change(uuid)):
            continue
        if mapping is None:
            for copy in live:
                yield Problem(INSTANCE_UNMAPPED, f"instance/{uuid}",
                              f"Instance {uuid} is visible in cell {copy.cell} but has no instance mapping.")
            continue
        cell = world.mapped_cell(uuid)
        if mapping.queued_for_delete:
            for copy in live:
                yield Problem(INSTANCE_MAPPING_MISMATCH, f"instance/{uuid}",
                              f"Instance {uuid} is visible in cell {copy.cell} but its mapping is queued for delete.")
        elif cell is None:
            if uuid not in world.build_requests:
                yield Problem(INSTANCE_NOT_VISIBLE, f"instance/{uuid}",
                              f"Instance mapping {uuid} names no cell and there is no build request for it.")
        else:
            if not any(c.cell == cell for c in live):
                where = ", ".join(f"{c.cell} ({'hidden' if c.row.hidden else 'visible'}"
                                  f"{', deleted' if c.row.deleted else ''})" for c in copies) or "nowhere"
                yield Problem(INSTANCE_NOT_VISIBLE, f"instance/{uuid}",
                              f"Instance {uuid} is mapped to cell {cell} but has no visible copy there; "
                              f"copies: {where}.")
            for copy in live:
                if copy.cell != cell:
                    yield Problem(INSTANCE_MAPPING_MISMATCH, f"instance/{uuid}@{copy.cell}",
                                  f"Instance {uuid} is visible in cell {copy.cell} as well as in its mapped cell "
                                  f"{cell}.")
        explained = any(m.cross_cell_move for m in world.open_migrations(uuid))
        for copy in copies:
            if copy.row.hidden and copy.cell != cell and not explained:
                yield Problem(HIDDEN_COPY_STALE, f"instance/{uuid}@{copy.cell}",
                              f"Cell {copy.cell} keeps a hidden copy of instance {uuid} (host {copy.row.host}) "
                              f"that no move between cells explains.",
                              _repair_hidden_copy(world, copy))


def _expected_allocations(world: _World) -> dict[str, tuple[str, dict[str, dict[str, int]]]]:
    """``{consumer: (what it is, {rp_uuid: {rc: n}})}`` for every settled server and its finished migration."""
    expected: dict[str, tuple[str, dict[str, dict[str, int]]]] = {}
    for uuid in world.copies:
        instance = world.settled(uuid)
        if instance is None:
            continue
        cell = world.mapped_cell(uuid) or ""
        bfv = world.is_bfv(cell, uuid)
        provider = world.provider_for(instance.node, instance.host)
        if provider is not None:
            expected[uuid] = (f"server {uuid} on {provider.name}",
                              _amounts(provider.uuid, placement.resources_from_flavor(instance.flavor, bfv)))
        if instance.vm_state == states.RESIZED:
            finished = [m for m in world.open_migrations(uuid) if m.status == migration_states.FINISHED]
            if finished and instance.old_flavor:
                migration = finished[-1]
                source = world.provider_for(migration.source_node, migration.source_compute)
                if source is not None:
                    expected[migration.uuid] = (
                        f"migration {migration.uuid} of server {uuid} on {source.name}",
                        _amounts(source.uuid, placement.resources_from_flavor(instance.old_flavor, bfv)))
    return expected


def _amounts(rp_uuid: str, resources: dict[str, int]) -> dict[str, dict[str, int]]:
    return {rp_uuid: dict(resources)} if resources else {}


def _check_allocations(world: _World) -> Iterable[Problem]:
    """Allocations equal the flavors of where servers live; none for what is gone; providers within capacity."""
    expected = _expected_allocations(world)
    names = {p.uuid: p.name for p in world.providers.values()}

    def where(held: dict[str, dict[str, int]]) -> str:
        return "; ".join(f"{names.get(rp, rp)}: {amounts}" for rp, amounts in sorted(held.items())) or "nothing"

    for consumer, held in sorted(world.allocations.items()):
        row = world.consumers.get(consumer)
        if row is not None and world.recent(_changed(row)):
            continue
        resource = f"allocation/{consumer}"
        if consumer in expected:
            what, wanted = expected[consumer]
            if held != wanted:
                yield Problem(ALLOCATION_MISMATCH, resource,
                              f"Consumer {consumer} ({what}) holds {where(held)}; its flavor needs {where(wanted)}.")
            continue
        migration = world.migrations.get(consumer)
        if migration is not None:
            instance_uuid = migration.instance_uuid
            if not world.exists(instance_uuid):
                yield Problem(ALLOCATION_ORPHAN, resource,
                              f"Migration {consumer} of deleted server {instance_uuid} holds {where(held)}.",
                              _repair_allocation(world, consumer))
            elif migration.status in IN_FLIGHT or world.in_flight(instance_uuid):
                continue
            elif migration.status in (migration_states.CONFIRMED, migration_states.REVERTED):
                yield Problem(ALLOCATION_ORPHAN, resource,
                              f"Migration {consumer} is {migration.status} but still holds {where(held)}.",
                              _repair_allocation(world, consumer))
            else:
                yield Problem(MIGRATION_ALLOCATION_HELD, resource,
                              f"Migration {consumer} ({migration.status}) of server {instance_uuid} holds "
                              f"{where(held)} although the server is not waiting in VERIFY_RESIZE for it.")
            continue
        if consumer in world.copies or consumer in world.build_requests:
            if not world.exists(consumer):
                yield Problem(ALLOCATION_ORPHAN, resource,
                              f"Deleted server {consumer} still holds {where(held)}.",
                              _repair_allocation(world, consumer))
            continue  # a server with a task, in ERROR or building: its allocation is its own
        yield Problem(ALLOCATION_ORPHAN, resource,
                      f"Consumer {consumer} is no server and no migration, and holds {where(held)}.",
                      _repair_allocation(world, consumer))
    for consumer, (what, wanted) in sorted(expected.items()):
        if wanted and consumer not in world.allocations and not world.recent(world.last_change(
                world.migrations[consumer].instance_uuid if consumer in world.migrations else consumer)):
            yield Problem(ALLOCATION_MISSING, f"allocation/{consumer}",
                          f"Consumer {consumer} ({what}) holds no allocation; its flavor needs {where(wanted)}.")
    used: dict[tuple[str, str], int] = defaultdict(int)
    for held in world.allocations.values():
        for rp, amounts in held.items():
            for rc, amount in amounts.items():
                used[(rp, rc)] += amount
    provider_names = {p.id: p.name for p in world.providers.values()}
    for inventory in sorted(world.inventories.values(), key=lambda i: (i.resource_provider_id, i.resource_class)):
        # Compared as one statement read them, whenever the provider last changed (its host
        # reports every minute): a claim under way shows in neither or both.
        counted, allocated = world.usage.get(inventory.id, (inventory.used, inventory.used))
        if counted != allocated:
            name = provider_names[inventory.resource_provider_id]
            yield Problem(INVENTORY_USAGE_DRIFT, f"provider/{name}/{inventory.resource_class}",
                          f"Resource provider {name} counts {counted} {inventory.resource_class} "
                          f"used, but its allocations add up to {allocated}.",
                          _repair_usage(inventory.id, counted))
    for (rp, rc), amount in sorted(used.items()):
        provider = world.providers[rp]
        limit = world.inventories.get((provider.id, rc))
        room = placement.capacity(limit.total, limit.reserved, limit.allocation_ratio) if limit is not None else 0
        if amount > room:
            yield Problem(PROVIDER_OVER_CAPACITY, f"provider/{provider.name}",
                          f"Resource provider {provider.name} has {amount} {rc} allocated, more than its capacity "
                          f"{room:g}.")


def _owner_hosts(world: _World, uuid: str) -> set[str]:
    """Hosts where the server may have a guest, disks, bindings or attachments: its own, its unsettled moves' ends."""
    found = {c.row.host for c in world.copies.get(uuid, []) if not c.row.deleted and c.row.host}
    for migration in world.unsettled_migrations(uuid):
        found |= {h for h in (migration.source_compute, migration.dest_compute) if h}
    return found


def _check_hosts(world: _World) -> Iterable[Problem]:
    """Each guest and instance directory a host reports belongs to a server there; each settled server has its guest."""
    for host, view in sorted(world.views.items()):
        for uuid in sorted(view.guests):
            if host in _owner_hosts(world, uuid) or not world.report_covers(view, uuid):
                continue
            yield Problem(GUEST_ORPHAN, f"host/{host}/guest/{uuid}",
                          f"Host {host} has a guest {uuid} but no server of that uuid lives there"
                          f"{' (the server is deleted)' if uuid in world.copies else ''}.")
        for name in sorted(view.instance_dirs or ()):
            matched = protocol.INSTANCE_DIR_NAME.match(name)
            if matched is None:
                continue
            uuid = matched["uuid"]
            if not world.report_covers(view, uuid):
                continue
            if matched["kind"] == "_resize":
                owned = any(m.source_compute == host for m in world.unsettled_migrations(uuid))
            elif matched["kind"] == "_incoming":  # disks a move is copying here
                owned = any(m.dest_compute == host and m.status in FORWARD for m in world.unsettled_migrations(uuid))
            else:
                owned = host in _owner_hosts(world, uuid)
            if not owned:
                yield Problem(INSTANCE_DIR_ORPHAN, f"host/{host}/dir/{name}",
                              f"Host {host} keeps the instance directory {name} that no server or move there owns.")
    for uuid in sorted(world.copies):
        instance = world.settled(uuid)
        if instance is None or instance.host is None:
            continue
        seen = world.views.get(instance.host)
        if seen is None or not world.report_covers(seen, uuid) or uuid in seen.guests:
            continue
        yield Problem(GUEST_MISSING, f"instance/{uuid}",
                      f"Server {uuid} ({instance.vm_state}) lives on host {instance.host}, whose report of "
                      f"{seen.sent_at.isoformat()} lists no guest for it.")


def _check_ports_and_volumes(world: _World) -> Iterable[Problem]:
    """Bindings and attachments only on the hosts of live servers and their open moves; settled ports bound."""
    for port in sorted(world.ports, key=lambda p: p.id):
        uuid = port.device_id
        for binding in sorted(port.bindings, key=lambda b: b.host):
            resource = f"port/{port.id}@{binding.host}"
            if uuid is None:
                if not world.recent(_changed(port)):
                    yield Problem(PORT_BINDING_ORPHAN, resource,
                                  f"Port {port.id} belongs to no server but is bound to host {binding.host}.",
                                  _repair_binding(world, port, binding))
            elif not world.exists(uuid):
                if not world.recent(world.last_change(uuid)):
                    yield Problem(PORT_BINDING_ORPHAN, resource,
                                  f"Port {port.id} of deleted server {uuid} is still bound to host {binding.host}.",
                                  _repair_ports_of_deleted(uuid))
            elif world.settled(uuid) is not None and binding.host not in _owner_hosts(world, uuid) \
                    and not world.recent(world.last_change(uuid)):
                yield Problem(PORT_BINDING_ORPHAN, resource,
                              f"Port {port.id} of server {uuid} is bound to host {binding.host}, where neither the "
                              f"server nor a move of it is.", _repair_binding(world, port, binding))
        if uuid is not None:
            instance = world.settled(uuid)
            if instance is not None and instance.host and not world.recent(world.last_change(uuid)) and not any(
                    b.host == instance.host and b.status == network.ACTIVE for b in port.bindings):
                yield Problem(PORT_BINDING_MISSING, f"port/{port.id}",
                              f"Port {port.id} of server {uuid} has no ACTIVE binding on its host {instance.host}.")
    for attachment in sorted(world.attachments, key=lambda a: a.id):
        uuid = attachment.instance_uuid
        resource = f"volume_attachment/{attachment.id}"
        if world.recent(world.last_change(uuid)) or world.recent(_changed(attachment)):
            continue
        if not world.exists(uuid):
            yield Problem(VOLUME_ATTACHMENT_ORPHAN, resource,
                          f"Volume {attachment.volume_id} is still attached to deleted server {uuid} "
                          f"on host {attachment.host}.", _repair_attachment(world, attachment, server_lives=False))
        elif world.settled(uuid) is not None and attachment.host and attachment.host not in _owner_hosts(world, uuid):
            yield Problem(VOLUME_ATTACHMENT_ORPHAN, resource,
                          f"Volume {attachment.volume_id} of server {uuid} is attached on host {attachment.host}, "
                          f"where neither the server nor a move of it is.",
                          _repair_attachment(world, attachment, server_lives=True))


def _check_volumes_left(world: _World) -> Iterable[Problem]:
    """A volume deleted with its server whose file no host removed waits for a person."""
    for volume in sorted(world.left_deleting, key=lambda v: v.id):
        if not volume.attachments and not world.recent(_changed(volume)):
            yield Problem(VOLUME_LEFT_DELETING, f"volume/{volume.id}",
                          f"Volume {volume.id} was deleted with its server, but no host removed what is at "
                          f"{volume.path}.")


def _check_volume_operations(world: _World) -> Iterable[Problem]:
    """A volume ``attaching`` or ``detaching`` only while its server's attach or detach is under way;
    never ``error_detaching`` for good.

    An attach or detach whose start answered an error is undone server first (task cleared), then
    the volume's records; an undo that failed in between leaves the volume in that status for good
    (no new attach or detach takes it), with, for an attach, a ``reserved`` attachment a later move
    of the server would carry along and complete. A detach that failed after its host detached the
    volume, but before the records said so, leaves it ``error_detaching`` (FailVolumeOperation), still
    held and mapped by its server: no detach takes it again (one needs ``in-use``), nor a forget."""
    for volume in sorted(world.operating, key=lambda v: v.id):
        holders = sorted({a.instance_uuid for a in volume.attachments})
        if world.recent(_changed(volume)) or any(world.recent(_changed(a)) for a in volume.attachments):
            continue
        # A deleted holder is volume_attachment_orphan's; one with a task or a move is its workflow's (or
        # instance_task_stuck's); one with a workflow running (an admin reset its task) is left to it.
        if any(world.visible(u) is None or world.in_flight(u) or world.recent(world.last_change(u))
               or world.live(u) for u in holders):
            continue
        resource, status = f"volume/{volume.id}", volume.status
        if not holders:
            # A server whose mapping names it (an attach that died between the server's records and
            # the volume's, its server's task then reset) may still be given it: not freed then.
            mappers = sorted(u for u, v in world.volume_mappings if v == volume.id)
            if mappers:
                yield Problem(VOLUME_OPERATION_LEFT, resource,
                              f"Volume {volume.id} is {status}, held by no attachment, but server(s) "
                              f"{', '.join(mappers)} map it.")
                continue
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"Volume {volume.id} is {status}, but no server holds or maps it: "
                          f"{_LEFT_BY[status]}.", _repair_volume_operation(world, volume, None))
            continue
        if len(holders) > 1:
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"Volume {volume.id} is {status} and held by servers {', '.join(holders)}, none of which "
                          f"has an {_OPERATION[status]} under way.")
            continue
        [holder] = holders
        mapped = (holder, volume.id) in world.volume_mappings
        reserved_only = all(a.status == volumes.RESERVED for a in volume.attachments)
        undone = not mapped and reserved_only if status == volumes.ATTACHING else mapped and not reserved_only
        message = (f"Volume {volume.id} is {status}, but server {holder} has no {_OPERATION[status]} under way "
                   f"(no task, no workflow running)")
        if not undone:
            statuses = ", ".join(sorted({a.status for a in volume.attachments}))
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"{message}, and its records disagree: the server {'maps' if mapped else 'does not map'} "
                          f"the volume, its attachments are {statuses}.")
        elif world.running is None:
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"{message} as far as can be told (the running workflows could not be listed): "
                          f"{_LEFT_BY[status]}.")
        else:
            yield Problem(VOLUME_OPERATION_LEFT, resource, f"{message}: {_LEFT_BY[status]}"
                          f"{_FIX_SAYS.get(status, '')}.", _repair_volume_operation(world, volume, holder))


def _check_volumes_reserved(world: _World) -> Iterable[Problem]:
    """A ``reserved`` volume only while something holds it: a boot reserves a volume (or makes one from
    an image) together with its attachment and build request, and releases both together.

    One nothing holds (no attachment, no build request names it, no server maps it) was left by a
    repair or a release that stopped halfway: no boot takes it (one needs ``available``), nor a forget.
    """
    for volume in sorted(world.reserved, key=lambda v: v.id):
        if volume.attachments or volume.id in world.build_volumes or world.recent(_changed(volume)):
            continue
        owner = world.made_for.get(volume.id)
        mappers = sorted(u for u, v in world.volume_mappings if v == volume.id)
        if any(world.recent(world.last_change(u)) for u in [*mappers, *([owner] if owner else [])]):
            continue
        resource = f"volume/{volume.id}"
        if mappers:
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"Volume {volume.id} is reserved, held by no attachment, but server(s) "
                          f"{', '.join(mappers)} map it.")
        elif owner is not None and world.exists(owner):
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"Volume {volume.id} is reserved, made for server {owner}, which exists but neither "
                          f"holds nor maps it.")
        else:
            made_for_it, hosted = owner is not None, owner is not None and _hosted(world, owner)
            if not made_for_it:
                release = "makes it available (an existing volume)"
            elif hosted:
                release = (f"marks it deleting (made from an image for server {owner}, which reached a host: what "
                           f"is at its path may remain, see volume_left_deleting)")
            else:
                release = f"deletes it (made from an image for server {owner}, which never reached a host)"
            yield Problem(VOLUME_OPERATION_LEFT, resource,
                          f"Volume {volume.id} is reserved, but no attachment, build request or server holds it: "
                          f"a boot's release stopped halfway; --fix {release}.",
                          _repair_reserved(volume, made_for_it=made_for_it, hosted=hosted))


def _hosted(world: _World, uuid: str) -> bool:
    """Whether any copy of the server, deleted or not, was ever given a host (whose spawn may have
    written the volumes made for it)."""
    return any(c.row.host or c.row.launched_on for c in world.copies.get(uuid, []))



_OPERATION = {volumes.ATTACHING: "attach", volumes.DETACHING: "detach", volumes.ERROR_DETACHING: "detach"}
# What leaves a volume in each status for good.
_LEFT_BY = {
    volumes.ATTACHING: "an attach that did not start was partly undone",
    volumes.DETACHING: "a detach that did not start was partly undone",
    volumes.ERROR_DETACHING: "a detach failed after its host detached the volume, and the records could not be "
                             "updated (see the server's fault)",
}
# What --fix does, where the status does not say it.
_FIX_SAYS = {volumes.ERROR_DETACHING: "; --fix makes it in-use again, as its server's records have it, so that "
                                      "a detach can be asked again (a host detaches a volume it does not have "
                                      "as a no-op)"}


def _check_storage(world: _World, skipped: list[str]) -> Iterable[Problem]:
    """Temporary snapshots (their image objects and their extents) and disk transfers only while the move
    that made them is under way."""
    from ferry.workflows.cross_cell import snapshot_image_id

    snapshots = {snapshot_image_id(m.uuid): m for m in world.migrations.values() if m.cross_cell_move}
    bucket = config.get().image_bucket
    try:
        paginator = aws.client("s3").get_paginator("list_objects_v2")
        # The extents before the image objects: an upload writes its image object last, so one that
        # finishes between the two listings is seen with its image object.
        extents = _objects_by_folder(paginator, bucket, images.DATA_PREFIX)
        listed = images.list_images()
        transfers = _objects_by_folder(paginator, bucket, images.TRANSFER_PREFIX)
    except (ClientError, BotoCoreError) as exc:
        skipped.append(f"image bucket {bucket}: listing failed ({exc}); snapshots and transfers were not checked")
        return
    for image in listed:
        migration = snapshots.get(image["id"])
        if migration is None and not image["name"].endswith(SNAPSHOT_SUFFIX):
            continue
        modified = hosts.report_time(image["updated_at"]) if image.get("updated_at") else None
        if world.recent(modified):
            continue
        if migration is None:
            yield Problem(SNAPSHOT_IMAGE_ORPHAN, f"image/{image['id']}",
                          f"Image {image['id']} ({image['name']}) is named like a move's temporary snapshot but no "
                          f"move made it; check who uploaded it.")
        elif migration.status not in FORWARD:
            yield Problem(SNAPSHOT_IMAGE_ORPHAN, f"image/{image['id']}",
                          f"Image {image['id']} ({image['name']}) is the temporary snapshot of migration "
                          f"{migration.uuid}, which is {migration.status}.", _repair_image(image["id"]))
    with_object = {image["id"] for image in listed}
    for image_id, objects in sorted(extents.items()):
        # An image object takes its extents with it (the image check above judges it).
        if image_id in with_object or world.recent(_newest(objects)):
            continue
        migration = snapshots.get(image_id)
        resource = f"s3://{bucket}/{images.DATA_PREFIX}{image_id}/"
        if migration is None:
            yield Problem(SNAPSHOT_DATA_ORPHAN, resource,
                          f"{len(objects)} snapshot extent object(s) of image {image_id} remain without their image "
                          f"object, and no move is known to have made them; check who wrote them.")
        elif migration.status not in FORWARD:
            yield Problem(SNAPSHOT_DATA_ORPHAN, resource,
                          f"{len(objects)} extent object(s) of the temporary snapshot of migration {migration.uuid} "
                          f"remain without their image object; the migration is {migration.status}.",
                          _repair_snapshot_data(bucket, image_id, [o["Key"] for o in objects]))
    for migration_uuid, objects in sorted(transfers.items()):
        migration = world.migrations.get(migration_uuid)
        if migration is not None and migration.status in FORWARD + (migration_states.REVERTING,):
            continue
        if world.recent(_newest(objects)):
            continue
        state = f"is {migration.status}" if migration is not None else "does not exist"
        yield Problem(TRANSFER_ORPHAN, f"s3://{bucket}/{images.TRANSFER_PREFIX}{migration_uuid}/",
                      f"{len(objects)} disk transfer object(s) of migration {migration_uuid} remain; the migration "
                      f"{state}.", _repair_transfer(bucket, [o["Key"] for o in objects]))


def _objects_by_folder(paginator: Any, bucket: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """The objects under ``prefix`` by their first folder there (``<prefix><folder>/…``)."""
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix):].split("/", 1)[0]].append(item)
    return found


def _newest(objects: list[dict[str, Any]]) -> dt.datetime:
    """The newest ``LastModified`` of listed objects, naive UTC as the records' times."""
    newest = max(cast(dt.datetime, o["LastModified"]) for o in objects)
    return newest.astimezone(dt.UTC).replace(tzinfo=None) if newest.tzinfo else newest


def _check_migrations(world: _World) -> Iterable[Problem]:
    """A finished migration only while its server waits in VERIFY_RESIZE; none stuck without a workflow."""
    for migration_uuid, migration in sorted(world.migrations.items()):
        uuid = migration.instance_uuid
        if world.recent(_changed(migration)):
            continue
        instance = world.visible(uuid)
        if migration.status == migration_states.FINISHED:
            newest = world.open_migrations(uuid)[-1]
            if instance is None or instance.vm_state != states.RESIZED or newest.uuid != migration_uuid:
                # A server with no visible copy may still exist (a hidden one, instance_not_visible): once
                # its copy is visible again it waits in VERIFY_RESIZE for this very migration, which
                # must then still be finished. So only a server that does not exist is judged gone.
                hidden = instance is None and world.exists(uuid)
                if instance is not None:
                    state = f"is {instance.vm_state}"
                elif hidden:
                    state = "has no visible copy in its cell (make it visible first: instance_not_visible)"
                else:
                    state = "is gone"
                yield Problem(MIGRATION_STATE_MISMATCH, f"migration/{migration_uuid}",
                              f"Migration {migration_uuid} is finished but its server {uuid} {state}"
                              f"{'' if newest.uuid == migration_uuid else ' and has a newer move'}.",
                              _repair_migration(world, migration_uuid, migration_states.FINISHED)
                              if not world.in_flight(uuid) and not hidden else None)
        elif migration.status in IN_FLIGHT:
            live = world.live(uuid)
            if live:
                continue
            if live is None and instance is not None and (
                    instance.task_state is not None or migration.status in SETTLING):
                continue  # a workflow may still run; it cannot be told
            if live is False:
                why = "no listed workflow runs for it" if world.unlisted else "no workflow runs for it"
            else:
                why = "its server has no task"
            # Repaired only when a move running for it would have been listed (see the skipped note).
            repairable = live is False and not world.unlisted
            cell = world.mapped_cell(uuid)
            # Only a confirm that would be accepted again: the server waits in VERIFY_RESIZE on the
            # move's destination, with no task (a confirm refused for want of that is put in error).
            confirm = _unbegun_confirm(cell, uuid) if (
                cell is not None and migration.status == migration_states.CONFIRMING and instance is not None
                and instance.vm_state == states.RESIZED and instance.task_state is None
                and instance.host == migration.dest_compute) else None
            if confirm is not None:
                why += "; its confirm was accepted but never began"
            repair = None
            if repairable:
                repair = _unless_running(world, uuid, _give_confirm_back(cell, uuid, migration_uuid, confirm)
                                         if cell and confirm else _repair_migration(world, migration_uuid,
                                                                                    migration.status))
            yield Problem(MIGRATION_STUCK, f"migration/{migration_uuid}",
                          f"Migration {migration_uuid} of server {uuid} has been {migration.status} since "
                          f"{_changed(migration).isoformat()} and {why}.", repair)
    for uuid in sorted(world.copies):
        instance = world.visible(uuid)
        if instance is None or instance.task_state is None or world.live(uuid) is not False:
            continue
        if world.recent(world.last_change(uuid)):
            continue
        yield Problem(INSTANCE_TASK_STUCK, f"instance/{uuid}",
                      f"Server {uuid} has had task {instance.task_state} since "
                      f"{_changed(instance).isoformat()} and no workflow runs for it.")
    # A boot whose workflow ended before it handed the server to a cell (stopped by hand, its
    # rollback failed for good) or never started (its start's undo failed) leaves a build request.
    for uuid in sorted(world.build_requests):
        mapping = world.mappings.get(uuid)
        if (mapping is not None and (mapping.queued_for_delete or world.mapped_cell(uuid) is not None)) \
                or world.boots_unlisted or world.live(uuid) is not False or world.recent(world.last_change(uuid)):
            continue
        held = sorted(world.providers[rp].name if rp in world.providers else rp
                      for rp in world.allocations.get(uuid, {}))
        copies = sorted(c.cell for c in world.copies.get(uuid, []) if not c.row.deleted)
        yield Problem(BUILD_REQUEST_STUCK, f"instance/{uuid}",
                      f"Server {uuid} is still a build request (BUILD, scheduling) and no boot workflow runs for "
                      f"it" + (f"; it holds a claim on {', '.join(held)}" if held else "")
                      + (f"; a copy never handed over is in {', '.join(copies)}" if copies else "") + ".")


# --- repairs ------------------------------------------------------------------------------------


def _repair_allocation(world: _World, consumer: str) -> Callable[[], str]:
    seen = world.consumers.get(consumer)
    generation = seen.generation if seen is not None else None

    def repair() -> str:
        # Only if nothing wrote the consumer since it was read (else AllocationConflict, not repaired).
        placement.set_allocations({consumer: {"allocations": {}, "consumer_generation": generation}})
        return f"deleted the allocations of consumer {consumer}"

    return repair


def _allocated_sum() -> Any:
    """What the allocations of an inventory's provider and class add up to, as a correlated subquery."""
    return (select(func.coalesce(func.sum(Allocation.used), 0))
            .where(Allocation.resource_provider_id == Inventory.resource_provider_id,
                   Allocation.resource_class == Inventory.resource_class)
            .scalar_subquery())


def _repair_usage(inventory_id: int, seen: int) -> Callable[[], str]:
    def repair() -> str:
        with api_session() as session:
            inventory = session.get(Inventory, inventory_id)
            if inventory is None:
                return "the inventory was already gone"
            # Only over the value read (every placement write refreshes the counter in its
            # transaction), and summed in the UPDATE itself: a claim committed between a read of
            # the sum and the write would leave the sum read stale.
            result = cast(CursorResult[Any], session.execute(
                update(Inventory).where(Inventory.id == inventory_id, Inventory.used == seen)
                .values(used=_allocated_sum()).execution_options(synchronize_session=False)))
            if result.rowcount != 1:
                raise errors.FerryError(f"the {inventory.resource_class} counter changed meanwhile; left as it is")
            now = session.scalar(select(Inventory.used).where(Inventory.id == inventory_id))
            return f"set the {inventory.resource_class} used counter from {seen} to {now}"

    return repair


def _same(column: InstrumentedAttribute[Any], value: Any) -> ColumnElement[bool]:
    return column.is_(None) if value is None else column == value


def _move_using(session: Session, instance_uuid: str, host: str, seen: set[tuple[str, str]]) -> Migration | None:
    """A migration of the server that may hold records on ``host`` now: one open, or one the audit's read did not
    see as it is, whose source or destination is ``host`` or whose destination is not chosen yet.

    Read from every cell (``session`` is an API database session, for the cell list): a move records its
    migration before it binds ports or reserves volumes on its destination.
    """
    for cell in session.scalars(select(CellMapping).order_by(CellMapping.id)):
        with cell_session(cell) as cell_db:
            for migration in cell_db.scalars(select(Migration).where(
                    Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False))):
                involved = migration.dest_compute is None or host in (migration.source_compute,
                                                                     migration.dest_compute)
                if involved and (migration.status in OPEN or (migration.uuid, migration.status) not in seen):
                    return migration
    return None


def _delete_as_read(session: Session, model: Any, row_id: Any, what: str, *as_read: ColumnElement[bool]) -> bool:
    """Delete the row ``row_id`` of ``model`` only while its columns are as the audit read them
    (``as_read``); False when it is gone already.

    Raises:
        FerryError: it changed meanwhile (left as it is).
    """
    result = cast(CursorResult[Any], session.execute(
        delete(model).where(model.id == row_id, *as_read).execution_options(synchronize_session=False)))
    if result.rowcount == 1:
        return True
    if session.get(model, row_id) is None:
        return False
    raise errors.FerryError(f"{what} changed meanwhile; left as it is")


def _refuse_if_moving(session: Session, instance_uuid: str, host: str, seen: set[tuple[str, str]], what: str) -> None:
    """Refuse (rolling the repair back) when a move of the server involving ``host`` began since the
    read: a move reuses a binding or an attachment it finds on its destination unchanged.

    Raises:
        FerryError: such a move.
    """
    move = _move_using(session, instance_uuid, host, seen)
    if move is not None:
        raise errors.FerryError(f"migration {move.uuid} ({move.status}) of server {instance_uuid} involves host "
                                f"{host} now; {what} was left as it is")


def _repair_binding(world: _World, port: Port, binding: PortBinding) -> Callable[[], str]:
    binding_id, port_id, host, status, device_id = binding.id, port.id, binding.host, binding.status, port.device_id
    seen = world.seen_migrations(device_id) if device_id is not None else set()

    def repair() -> str:
        with api_session() as session:
            # Only the binding as read, of the port still owned as read (a move keeps an existing binding
            # unchanged, so the server's moves are re-read below, before this delete commits).
            owned_as_read = select(Port.id).where(Port.id == port_id, _same(Port.device_id, device_id)).exists()
            what = f"the binding of port {port_id} on host {host}"
            if not _delete_as_read(session, PortBinding, binding_id, what, PortBinding.port_id == port_id,
                                   PortBinding.host == host, PortBinding.status == status, owned_as_read):
                return "the binding was already gone"
            if device_id is not None:
                _refuse_if_moving(session, device_id, host, seen, what)
            return f"deleted {what}"

    return repair


def _repair_ports_of_deleted(instance_uuid: str) -> Callable[[], str]:
    def repair() -> str:
        with api_session() as session:
            network.release_ports(session, instance_uuid, network.requested_networks(session, instance_uuid))
        return f"released the ports of deleted server {instance_uuid} (as its delete does)"

    return repair


def _repair_attachment(world: _World, attachment: VolumeAttachment, *, server_lives: bool) -> Callable[[], str]:
    attachment_id, volume_id, instance_uuid = attachment.id, attachment.volume_id, attachment.instance_uuid
    host, status, updated_at = attachment.host, attachment.status, attachment.updated_at
    volume_status = world.volume_statuses.get(volume_id)
    seen = world.seen_migrations(instance_uuid)
    made_for_it, hosted = world.made_for.get(volume_id) == instance_uuid, _hosted(world, instance_uuid)
    # A live server's mapping of the volume keeps it reserved (reported then, for a person).
    mapped_elsewhere = any(v == volume_id and world.exists(u) for u, v in world.volume_mappings)

    def repair() -> str:
        with api_session() as session:
            # Only the attachment as read (a move keeps an existing reservation unchanged, so the server's
            # moves are re-read below, before this delete commits).
            what = f"the attachment of volume {volume_id} on host {host}"
            if not _delete_as_read(session, VolumeAttachment, attachment_id, what,
                                   VolumeAttachment.volume_id == volume_id,
                                   VolumeAttachment.instance_uuid == instance_uuid, _same(VolumeAttachment.host, host),
                                   VolumeAttachment.status == status, _same(VolumeAttachment.updated_at, updated_at)):
                return "the attachment was already gone"
            if server_lives and host:
                _refuse_if_moving(session, instance_uuid, host, seen, what)
            done = f"deleted {what}"
            if volume_status == volumes.RESERVED and not server_lives:
                # The root volume of a boot whose server is gone: released as the boot's undo and a
                # delete release it (only once no attachment holds it, from the status read).
                released = None if mapped_elsewhere else _release_reserved(session, volume_id,
                                                                           made_for_it=made_for_it, hosted=hosted)
                left = "the volume was left as it is (held or mapped by a server, or no longer reserved)"
                return f"{done}; {released or left}"
            if volume_status not in HELD_VOLUME_STATUSES:
                return done
            # Available only from the status read, and only when no attachment holds the volume any more.
            freed = cast(CursorResult[Any], session.execute(
                update(Volume).where(Volume.id == volume_id, Volume.status == volume_status, volumes.unheld())
                .values(status=volumes.AVAILABLE).execution_options(synchronize_session=False)))
            if freed.rowcount == 1:
                return f"{done}; the volume is available"
            return f"{done}; the volume was left as it is (still held, or no longer {volume_status})"

    return repair


def _release_reserved(session: Session, volume_id: str, *also: ColumnElement[bool], made_for_it: bool,
                      hosted: bool) -> str | None:
    """Release a ``reserved`` volume nothing holds, as a boot's undo and a delete do
    (:func:`ferry.compute.api._release_unbuilt_volumes`, :func:`ferry.workflows.delete._release_volumes`):
    one made from an image for the server that reserved it is deleted when that server never had a
    host (nothing wrote it), else left ``deleting`` for a person (what is at its path may remain); an
    existing volume becomes ``available``. In one statement, only while it is still ``reserved``, no
    attachment holds it, no build request names it, and the conditions ``also`` hold.

    Returns:
        What was done; None when the volume was left as it is.
    """
    if volume_id in _volumes_named_by_builds(session):
        return None
    as_read = (Volume.id == volume_id, Volume.status == volumes.RESERVED, volumes.unheld(), *also)
    if made_for_it and not hosted:
        result = session.execute(delete(Volume).where(*as_read).execution_options(synchronize_session=False))
        done = f"deleted volume {volume_id}, made for the server and never written"
    else:
        to_status = volumes.DELETING if made_for_it else volumes.AVAILABLE
        result = session.execute(update(Volume).where(*as_read).values(status=to_status)
                                 .execution_options(synchronize_session=False))
        done = (f"volume {volume_id} is deleting (made for the server, which reached a host: remove what is at "
                f"its path, then forget it)" if made_for_it else f"volume {volume_id} is available")
    return done if cast(CursorResult[Any], result).rowcount == 1 else None


def _repair_reserved(volume: Volume, *, made_for_it: bool, hosted: bool) -> Callable[[], str]:
    volume_id, updated_at = volume.id, volume.updated_at

    def repair() -> str:
        with api_session() as session:
            done = _release_reserved(session, volume_id, _same(Volume.updated_at, updated_at),
                                     made_for_it=made_for_it, hosted=hosted)
        if done is None:
            raise errors.FerryError(f"volume {volume_id} changed meanwhile (held, named by a build request, or no "
                                    f"longer reserved as read); left as it is")
        return done

    return repair


def _repair_volume_operation(world: _World, volume: Volume, holder: str | None) -> Callable[[], str]:
    """Finish the undo of an attach (the holder's ``reserved`` attachments deleted, the volume
    ``available``) or of a detach, or settle a detach that failed (``error_detaching``): the volume
    ``in-use`` again, as the holder's attachment and mapping have it, or ``available`` if nothing holds
    it; under the holder's row lock, while it still has no task and maps the volume as read."""
    volume_id, status, updated_at = volume.id, volume.status, volume.updated_at
    attachment_ids = [a.id for a in volume.attachments]
    cell = world.mapped_cell(holder) if holder is not None else None
    detach = status in (volumes.DETACHING, volumes.ERROR_DETACHING)
    to_status = volumes.IN_USE if holder is not None and detach else volumes.AVAILABLE

    def finish(session: Session) -> str:
        for attachment_id in attachment_ids if to_status == volumes.AVAILABLE else []:
            _delete_as_read(session, VolumeAttachment, attachment_id, f"the attachment of volume {volume_id}",
                            VolumeAttachment.instance_uuid == holder, VolumeAttachment.status == volumes.RESERVED)
        held = volumes.held_by(holder) if holder is not None and to_status == volumes.IN_USE else volumes.unheld()
        done = cast(CursorResult[Any], session.execute(
            update(Volume).where(Volume.id == volume_id, Volume.status == status, _same(Volume.updated_at, updated_at),
                                 held).values(status=to_status).execution_options(synchronize_session=False)))
        if done.rowcount != 1:
            raise errors.FerryError(f"volume {volume_id} changed meanwhile; left as it is")
        dropped = "deleted its reserved attachment(s); " if to_status == volumes.AVAILABLE and attachment_ids else ""
        return f"{dropped}volume {volume_id} is {to_status} again"

    def repair() -> str:
        if holder is None or cell is None:
            with api_session() as session:
                return finish(session)
        # The server's row lock, as an attach's or detach's first step takes it, held until the
        # volume's records commit: a new operation of the server either waits or is seen.
        with cell_session(cell) as cell_db:
            instance = cell_db.scalars(select(Instance).where(Instance.uuid == holder, Instance.deleted.is_(False))
                                       .with_for_update()).first()
            if instance is None or instance.task_state is not None:
                raise errors.FerryError(f"server {holder} is gone or has a task now; volume {volume_id} was left "
                                        f"as it is")
            mapped = cell_db.scalars(select(BlockDeviceMapping.id).where(
                BlockDeviceMapping.instance_uuid == holder, BlockDeviceMapping.volume_id == volume_id,
                BlockDeviceMapping.deleted.is_(False))).first() is not None
            if mapped != (to_status == volumes.IN_USE):
                raise errors.FerryError(f"server {holder}'s mapping of volume {volume_id} changed meanwhile; left "
                                        f"as it is")
            with api_session() as session:
                return finish(session)

    return repair


def _copy_as_read(session: Session, cell: str, instance_uuid: str, copy: tuple[int, dt.datetime | None],
                  seen: set[tuple[str, str]]) -> bool:
    """Whether the hidden copy the audit read is still in ``session``'s cell ``cell`` (False: it is gone).

    It must be the same row, unwritten since (``copy`` is its ``id`` and ``updated_at`` as read: a move's
    TargetDBSetup replaces a stale copy with a new row whose timestamps it copies from the server, and
    SQLite may give it the same ``id``), still hidden, and the cell must hold no migration of the server
    that was not read, nor a move between cells now open that was not read so (TargetDBSetup writes its
    copy and its migration in one transaction).

    Raises:
        FerryError: the copy or the cell's migrations of the server changed meanwhile.
    """
    row = session.scalars(select(Instance).where(Instance.uuid == instance_uuid).with_for_update()).one_or_none()
    if row is None:
        return False
    why = None
    if (row.id, row.updated_at) != copy:
        why = "another copy replaced it, or it was written"
    elif not row.hidden:
        why = "it is visible now"
    else:
        read = {uuid for uuid, _status in seen}
        for migration in session.scalars(select(Migration).where(
                Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False))):
            now_open = migration.cross_cell_move and migration.status in OPEN
            if migration.uuid not in read or (now_open and (migration.uuid, migration.status) not in seen):
                why = f"migration {migration.uuid} ({migration.status}) of the server is there now"
                break
    if why is not None:
        raise errors.FerryError(f"the hidden copy of instance {instance_uuid} in cell {cell} changed meanwhile "
                                f"({why}); left as it is")
    return True


def _repair_hidden_copy(world: _World, copy: _Copy) -> Callable[[], str]:
    from ferry.workflows import cross_cell_settle

    cell, instance_uuid, read = copy.cell, copy.row.uuid, (copy.row.id, copy.row.updated_at)
    in_cell = [m for c, m in (pair for ms in world.migration_copies.values() for pair in ms)
               if c == cell and m.instance_uuid == instance_uuid]
    seen = {(m.uuid, m.status) for m in in_cell}
    # The move the copy is left from: its migration is the cell's own; the others are carried to the server's cell.
    own = next((m.uuid for m in in_cell if m.cross_cell_move), "")

    def repair() -> str:
        with cell_session(cell) as session:
            if not _copy_as_read(session, cell, instance_uuid, read, seen):
                return "the hidden copy was already gone"
        cross_cell_settle.carry_older_migrations(cell, instance_uuid, own)
        # Checked again, and removed, in one transaction (the rows hard_delete_copy removes).
        with cell_session(cell) as session:
            if not _copy_as_read(session, cell, instance_uuid, read, seen):
                return "the hidden copy was already gone"
            instances.purge(session, instance_uuid)
        return f"hard-deleted the hidden copy of instance {instance_uuid} from cell {cell}"

    return repair


def _repair_image(image_id: str) -> Callable[[], str]:
    def repair() -> str:
        images.delete_image(image_id)
        return f"deleted image {image_id}"

    return repair


def _repair_snapshot_data(bucket: str, image_id: str, read: list[str]) -> Callable[[], str]:
    def repair() -> str:
        # Only while no image object points at them (an upload that finished since owns them), and only
        # the objects read: what was written since is left for the next run.
        try:
            images.get_image(image_id)
        except errors.ImageNotFound:
            pass
        else:
            raise errors.FerryError(f"image {image_id} has its image object now; its extents were left as they are")
        s3 = aws.client("s3")
        # A deletion may have finished since the audit read them: count only what is still there.
        still_there: set[str] = set()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                  Prefix=f"{images.data_prefix(image_id)}/"):
            still_there.update(item["Key"] for item in page.get("Contents", []))
        keys = [key for key in read if key in still_there]
        if not keys:
            return f"nothing was left to delete: no extent object of image {image_id} remains"
        _delete_objects(s3, bucket, keys, f"extent object(s) of image {image_id}")
        return f"deleted {len(keys)} extent object(s) of image {image_id}"

    return repair


def _repair_transfer(bucket: str, keys: list[str]) -> Callable[[], str]:
    def repair() -> str:
        _delete_objects(aws.client("s3"), bucket, keys, "transfer object(s)")
        return f"deleted {len(keys)} object(s)"

    return repair


def _delete_objects(s3: Any, bucket: str, keys: list[str], what: str) -> None:
    """Delete ``keys`` a thousand at a time (DeleteObjects' most).

    Raises:
        FerryError: S3 answered that some were not deleted (it does not raise for them).
    """
    for start in range(0, len(keys), 1000):
        done = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})
        if done.get("Errors"):
            raise errors.FerryError(f"S3 did not delete {len(done['Errors'])} {what}")


def _repair_migration(world: _World, migration_uuid: str, seen_status: str) -> Callable[[], str]:
    """Put the migration in ``error`` in every cell holding it; a stuck one's action (the move, or
    its confirm or revert) has the events its workflow left open ended ``Error`` with it, so the
    server's event list shows how the request ended."""
    copies = world.migration_copies.get(migration_uuid, [])
    action = _stuck_action(copies[0][1], seen_status) if copies else None
    error = {"Error": errors.MoveNotSettled.__name__,
             "Cause": f"The workflow of migration {migration_uuid} ended without settling it ({seen_status}); "
                      f"ferry audit put the migration in error."}

    def repair() -> str:
        changed, ended = 0, set()
        for cell, migration in copies:
            with cell_session(cell) as session:
                result = cast(CursorResult[Any], session.execute(
                    update(Migration).where(Migration.uuid == migration_uuid, Migration.status == seen_status)
                    .values(status=migration_states.ERROR).execution_options(synchronize_session=False)))
                changed += result.rowcount
                if result.rowcount and action is not None:
                    ended.update(actions.end_open_events(session, migration.instance_uuid, action, error))
        if not changed:
            raise errors.FerryError(f"migration {migration_uuid} is no longer {seen_status}; left as it is")
        return (f"set migration {migration_uuid} from {seen_status} to error"
                + (f" and ended its {action} action's open events ({', '.join(sorted(ended))}) Error"
                   if ended else ""))

    return repair


def _unless_running(world: _World, instance_uuid: str, repair: Callable[[], str]) -> Callable[[], str]:
    """``repair`` of what no workflow ran for when the audit read it, once the running workflows,
    listed again, still have none for the server: one started since (a failed execution redriven,
    a request accepted again) owns the records, and the repair leaves them to it."""

    def repair_if_still_alone() -> str:
        running, why = world.running_now()
        if running is None:
            raise errors.FerryError(f"the running workflows cannot be listed now ({why}), so whether one runs for "
                                    f"server {instance_uuid} cannot be told; left as it is")
        started = sorted(name for name in running if instance_uuid in name)
        if started:
            raise errors.FerryError(f"workflow {', '.join(started)} runs for server {instance_uuid} now; "
                                    f"left as it is")
        return repair()

    return repair_if_still_alone


def _stuck_action(migration: Migration, status: str) -> str | None:
    """The action whose workflow left ``migration`` in ``status`` (None for a finished one: its
    move ended). A server's newest such action is that one: no other move is accepted while one
    of its migrations is moving, confirming or reverting."""
    if status == migration_states.CONFIRMING:
        return actions.CONFIRM_RESIZE
    if status == migration_states.REVERTING:
        return actions.REVERT_RESIZE
    if status == migration_states.FINISHED:
        return None
    return actions.RESIZE if migration.migration_type == migration_states.RESIZE else actions.MIGRATE


def _unbegun_confirm(cell: str, instance_uuid: str) -> str | None:
    """The request id of the server's newest confirm when no step of it began (it recorded no
    event: its workflow never started), else None."""
    with cell_session(cell) as session:
        request_id = actions.newest_request_id(session, instance_uuid, actions.CONFIRM_RESIZE)
        if request_id is None or actions.has_events(session, instance_uuid, request_id):
            return None
        return request_id


def _give_confirm_back(cell: str, instance_uuid: str, migration_uuid: str, request_id: str) -> Callable[[], str]:
    """Undo a confirm accepted whose workflow never began, as its start's own undo does: the
    migration goes back from ``confirming`` to ``finished`` and the confirm's action is forgotten,
    so the server waits in VERIFY_RESIZE for a confirm or revert again (auto-confirm included).
    A migration put in ``error`` instead would leave the server resized with nothing that can
    confirm or revert it. Checked again under the server's row lock, which a first step takes."""

    def repair() -> str:
        with cell_session(cell) as session:
            if actions.request_taken(session, instance_uuid, request_id):
                raise errors.FerryError(f"the confirm of migration {migration_uuid} began meanwhile; left as it is")
            # Given back meanwhile (a drain's undo, another audit) and confirmed again under another
            # request: the migration is confirming for that one.
            if actions.find(session, instance_uuid, request_id) is None or \
                    actions.newest_request_id(session, instance_uuid, actions.CONFIRM_RESIZE) != request_id:
                raise errors.FerryError(f"the confirm of migration {migration_uuid} was given back meanwhile, and "
                                        f"another may be under way; left as it is")
            result = cast(CursorResult[Any], session.execute(
                update(Migration).where(Migration.uuid == migration_uuid,
                                        Migration.status == migration_states.CONFIRMING)
                .values(status=migration_states.FINISHED).execution_options(synchronize_session=False)))
            if not result.rowcount:
                raise errors.FerryError(f"migration {migration_uuid} is no longer confirming; left as it is")
            actions.forget_action(session, instance_uuid, request_id)
        return (f"gave migration {migration_uuid} back from confirming to finished (its confirm never began): "
                f"server {instance_uuid} waits in VERIFY_RESIZE again")

    return repair


# Repairs that change records other checks read run first, so the next round sees their effect.
_REPAIR_ORDER = (MIGRATION_STUCK, MIGRATION_STATE_MISMATCH, HIDDEN_COPY_STALE)


def _apply_repairs(problems: list[Problem]) -> list[Repair]:
    done = []
    ordered = sorted((p for p in problems if p.repair is not None),
                     key=lambda p: _REPAIR_ORDER.index(p.kind) if p.kind in _REPAIR_ORDER else len(_REPAIR_ORDER))
    for problem in ordered:
        assert problem.repair is not None
        try:
            action = problem.repair()
        # A database error (a deadlock or serialization failure against a workflow writing the same
        # rows, a connection lost) fails this repair only: its transaction was rolled back.
        except (errors.FerryError, ClientError, BotoCoreError, DBAPIError) as exc:
            logger.warning("audit repair failed", extra={"kind": problem.kind, "resource": problem.resource,
                                                         "error": str(exc)})
            done.append(Repair(problem, None, str(exc)))
            continue
        logger.info("audit repaired", extra={"kind": problem.kind, "resource": problem.resource, "action": action})
        done.append(Repair(problem, action))
    return done


# --- entry point --------------------------------------------------------------------------------


def _find_problems(grace_seconds: float, clock_skew_seconds: float, running: Collection[str] | None,
                   check_storage: bool, skipped: list[str]) -> list[Problem]:
    world = _read_world(grace_seconds, clock_skew_seconds, running, skipped)
    found = [*_check_instances(world), *_check_allocations(world), *_check_hosts(world),
             *_check_ports_and_volumes(world), *_check_volumes_left(world),
             *_check_volume_operations(world), *_check_volumes_reserved(world), *_check_migrations(world)]
    if check_storage:
        found += list(_check_storage(world, skipped))
    return found


def run_audit(*, fix: bool = False, grace_seconds: float = DEFAULT_GRACE_SECONDS,
              clock_skew_seconds: float = DEFAULT_CLOCK_SKEW_SECONDS,
              running_executions: Collection[str] | None = None, check_storage: bool = True,
              max_fix_rounds: int = 3) -> AuditReport:
    """Check Ferry's invariants across the store, placement, the image bucket and the hosts' reports.

    Params:
        fix: repair what is safe to repair (see each problem's ``fixable``), then check again.
        grace_seconds: records written more recently than this are not judged (a workflow may be
            between two writes).
        clock_skew_seconds: how far a host's clock may be ahead of the control plane's.
        running_executions: names of the workflow executions running now; by default they are
            listed from Step Functions (when no state machine is configured, nothing stuck is
            repaired), and listed again once before the repairs of stuck migrations. When given,
            those repairs look at the same names again (nothing is listed).
        check_storage: also check temporary snapshots and disk transfers in the image bucket.
        max_fix_rounds: a repair may reveal another (a migration put in error leaves its transfer
            to remove): repair and check again up to this many times.

    Returns:
        The problems left (after the repairs, with ``fix``), the repairs made and the checks skipped.
    """
    skipped: list[str] = []
    problems = _find_problems(grace_seconds, clock_skew_seconds, running_executions, check_storage, skipped)
    repairs: list[Repair] = []
    tried: set[tuple[str, str]] = set()
    rounds = 0
    while fix and rounds < max_fix_rounds:
        todo = [p for p in problems if p.fixable and (p.kind, p.resource) not in tried]
        if not todo:
            break
        rounds += 1
        repairs += _apply_repairs(todo)
        tried |= {(p.kind, p.resource) for p in todo}
        skipped = []
        problems = _find_problems(grace_seconds, clock_skew_seconds, running_executions, check_storage, skipped)
    report = AuditReport(problems=problems, repairs=repairs, skipped=sorted(set(skipped)))
    logger.info("audit finished", extra={"problems": len(problems), "repairs": len(repairs),
                                         "kinds": sorted(set(report.kinds()))})
    return report


def assert_consistent(**options: Any) -> AuditReport:
    """Run the audit (no repairs) and raise AssertionError listing every problem unless it is clean.

    For test suites: ``ferry.audit.assert_consistent(grace_seconds=0)`` once everything has settled.
    ``options`` are those of :func:`run_audit` (``fix`` excepted).
    """
    report = run_audit(fix=False, **options)
    if not report.clean:
        raise AssertionError("ferry audit found problems:\n" + report.describe())
    return report
