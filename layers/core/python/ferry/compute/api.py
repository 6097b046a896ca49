"""The compute API's domain: accept, show, list, delete, stop and start servers.

The HTTP layer (:mod:`ferry.api`) parses requests, enforces policy and renders; everything
that reads or changes records is here, so workflows and later API parts reuse it.

Where a server lives is decided by its instance mapping alone: a mapping without a cell
means the server is still a build request in the API database; otherwise its visible,
undeleted instance row in that cell is the server. Copies in other cells (hidden during a
cross-cell move) are never shown.

What :func:`create_server` writes, for the boot workflow:

* ``InstanceMapping`` (cell NULL);
* ``BuildRequest.instance``: instance column values (``display_name``,
  ``display_description``, ``hostname``, ``reservation_id``, ``launch_index``, ``user_data``, ``project_id``,
  ``user_id``, ``image_ref`` — ``""`` when volume-backed —, ``flavor`` snapshot,
  ``vm_state`` building, ``task_state`` scheduling, ``power_state`` 0,
  ``availability_zone``, ``key_name``, ``metadata``, ``locked``);
  ``block_device_mappings``: block device mapping column values (no ``instance_uuid``);
  ``tags``: a list of strings;
* ``RequestSpec.spec``: ``instance_uuid``, ``project_id``, ``user_id``, ``flavor``,
  ``image`` ``{id}``, ``is_bfv``, ``ignore_hosts``, ``requested_destination``,
  ``allowed_cells``, ``scheduler_hints`` (``same_host``/``different_host`` lists),
  ``group`` (``{uuid}`` of the server group it joined, or null), ``availability_zone`` and
  ``requested_networks`` (``[{network_id, port_id, preexisting, tag?}]``: ports the user
  brought are only detached when the server goes; ``tag`` is the device tag asked for);
* ports with a MAC and a fixed IP, and for a volume-backed server the root volume with a
  reserved attachment: a new one for an image (its file created by the host), or an existing
  one reserved.
"""

from __future__ import annotations

import datetime as dt
import heapq
import ipaddress
import itertools
import secrets
import uuid as uuidlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

from sqlalchemy import ColumnElement, CursorResult, and_, delete, select, tuple_, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from ferry import config, errors, hosts, images, network, placement, policy, protocol, quotas, validation, workflows
from ferry import volumes as volume_store
from ferry.auth import RequestContext
from ferry.compute import (
    actions,
    aggregates,
    flavor_access,
    instances,
    migration_states,
    server_filters,
    server_groups,
    services,
    states,
)
from ferry.compute.server_filters import ServerFilters
from ferry.observability import logger
from ferry.store import db
from ferry.store.api_models import (
    BuildRequest,
    CellMapping,
    Flavor,
    FlavorExtraSpec,
    FlavorProject,
    InstanceMapping,
    Network,
    Port,
    RequestSpec,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    InstanceFault,
    Migration,
    Tag,
)
from ferry.store.db import api_session, cell_session

SHARED_NETWORK_NAME = "shared"
SHARED_NETWORK_CIDR = "10.0.0.0/16"
# A fixed id makes creating the shared network on first use safe under concurrent boots.
SHARED_NETWORK_ID = str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "urn:ferry:network:shared"))
MAC_PREFIX = "fa:16:3e"
MAX_LIST_LIMIT = 1000
T = TypeVar("T")

# task_states a delete may interrupt (any task_state is accepted when vm_state is error).
DELETABLE_TASK_STATES: tuple[str | None, ...] = (None, states.DELETING, states.SCHEDULING, states.SPAWNING)

NETWORKS_AUTO = "auto"
NETWORKS_NONE = "none"


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    """Where a server lives: its mapping's identity and cell (None while it is a build request)."""

    instance_uuid: str
    project_id: str
    user_id: str | None
    cell: CellMapping | None

    @property
    def target(self) -> dict[str, Any]:
        """The policy target of the server."""
        return {"project_id": self.project_id, "user_id": self.user_id}


@dataclass
class Server:
    """A server as the API shows it, read from its cell or from its build request."""

    uuid: str
    name: str
    project_id: str
    user_id: str
    image_ref: str | None
    flavor: dict[str, Any]
    vm_state: str
    task_state: str | None
    power_state: int
    created_at: dt.datetime
    updated_at: dt.datetime | None = None
    host: str | None = None
    node: str | None = None
    instance_id: int | None = None
    availability_zone: str | None = None
    key_name: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    locked: bool = False
    launched_at: dt.datetime | None = None
    terminated_at: dt.datetime | None = None
    tags: list[str] = field(default_factory=list)
    fault: dict[str, Any] | None = None
    ports: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    cell: str | None = None
    # The zone the server was asked for (the scheduler keeps it there), from its request spec.
    pinned_availability_zone: str | None = None
    # Its host's status (2.16; only for callers the host_status policy allows), else None.
    host_status: str | None = None
    description: str | None = None
    hostname: str | None = None
    reservation_id: str | None = None
    launch_index: int = 0
    user_data: str | None = None

    @property
    def status(self) -> str:
        return states.api_status(self.vm_state, self.task_state)

    @property
    def target(self) -> dict[str, Any]:
        return {"project_id": self.project_id, "user_id": self.user_id}

    @property
    def instance_name(self) -> str:
        """The hypervisor-side name (Nova's ``instance-%08x``); empty before the server has a cell."""
        return f"instance-{self.instance_id:08x}" if self.instance_id is not None else ""


@dataclass(frozen=True)
class UnknownServer:
    """A server of a cell whose database does not answer, as the API database knows it: its
    id, its project and when it was accepted (its mapping's); for one server shown alone also
    its user (the mapping's) and, from its request spec, its flavor, image and requested zone.
    Shown with status ``UNKNOWN`` from 2.69 (Nova's partial record of a down cell)."""

    uuid: str
    project_id: str
    created_at: dt.datetime
    user_id: str | None = None
    flavor: dict[str, Any] | None = None
    image_ref: str | None = None
    availability_zone: str | None = None

    @property
    def target(self) -> dict[str, Any]:
        return {"project_id": self.project_id, "user_id": self.user_id}


@dataclass
class ServerPage:
    """A page of a server list, in its order: servers read from their cell or build request and,
    from 2.69, :class:`UnknownServer` records of cells whose database did not answer."""

    items: list[Server | UnknownServer]

    @property
    def servers(self) -> list[Server]:
        return [item for item in self.items if isinstance(item, Server)]

    @property
    def ids(self) -> list[str]:
        return [item.uuid for item in self.items]


@dataclass
class BootRequest:
    """What a create-server request asks for, already checked against the API schema.

    ``networks`` is ``"auto"``, ``"none"`` or a list of ``{"uuid": …}`` / ``{"port": …}``
    (either optionally with ``fixed_ip``); ``block_device_mapping`` uses Nova's v2 keys.
    """

    name: str
    flavor_ref: str
    image_ref: str | None = None
    description: str | None = None
    # The hostname asked for (2.90), else one made from the name; the create request's id
    # (``r-…``, shared by the servers of one request); user data as sent (base64).
    hostname: str | None = None
    reservation_id: str | None = None
    user_data: str | None = None
    networks: str | list[dict[str, Any]] = NETWORKS_AUTO
    metadata: dict[str, str] = field(default_factory=dict)
    key_name: str | None = None
    availability_zone: str | None = None
    block_device_mapping: list[dict[str, Any]] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    scheduler_hints: dict[str, Any] = field(default_factory=dict)
    # The host and compute node asked for (2.74, admins): the scheduler then checks that one only.
    requested_host: str | None = None
    requested_node: str | None = None
    # How many servers: at least min_count, as many as the quota allows up to max_count.
    min_count: int = 1
    max_count: int = 1


# --- small helpers -------------------------------------------------------------------------------


def normalize_uuid(value: str) -> str | None:
    """``value`` as a canonical uuid string, or None when it is not a uuid (a name, say)."""
    try:
        return str(uuidlib.UUID(value))
    except (ValueError, AttributeError, TypeError):
        return None


def ref_id(ref: str) -> str:
    """The id in a reference that may be an href (``…/flavors/<id>``) or a bare id."""
    return ref.rstrip("/").rsplit("/", 1)[-1]


def flavor_snapshot(flavor: Flavor) -> dict[str, Any]:
    """The copy of a flavor an instance keeps (so deleting the flavor never strands it)."""
    return {
        "id": flavor.id,
        "flavorid": flavor.flavorid,
        "name": flavor.name,
        "vcpus": flavor.vcpus,
        "memory_mb": flavor.memory_mb,
        "root_gb": flavor.root_gb,
        "ephemeral_gb": flavor.ephemeral_gb,
        "swap": flavor.swap,
        "extra_specs": dict(flavor.specs),
    }


def execution_name(kind: str, instance_uuid: str, request_id: str | None = None) -> str:
    """A Step Functions execution name for a workflow on an instance (at most 80 characters).

    The ``req-`` prefix of the request id is dropped to stay within the limit.
    """
    if request_id is None:
        return f"{kind}-{instance_uuid}"
    return f"{kind}-{instance_uuid}-{request_id.removeprefix('req-')}"


def _invalid_state(action: str, instance_uuid: str, attr: str, state: Any) -> errors.InstanceInvalidState:
    return errors.InstanceInvalidState(f"Cannot '{action}' instance {instance_uuid} while it is in {attr} {state}")


def refuse_live_migration_action(ctx: RequestContext, server_id: str, action: str) -> NoReturn:
    """Refuse ``action`` (abort, force_complete) on a server's live migration: Ferry moves servers
    cold only, so no server's task is ever ``migrating``, and Nova refuses the action then.

    Raises:
        InstanceNotFound: no such server for the caller.
        InstanceInvalidState: always otherwise (409), naming the server's task state.
    """
    server = get_server(ctx, server_id)
    raise _invalid_state(action, server.uuid, "task_state", server.task_state)


# --- request specs ---------------------------------------------------------------------------------


def load_request_spec(session: Session, instance_uuid: str) -> dict[str, Any]:
    """The request spec of an instance (a copy; change it and :func:`save_request_spec`).

    Raises:
        NotFound: the instance has no request spec.
    """
    row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == instance_uuid)).one_or_none()
    if row is None:
        raise errors.NotFound(f"Request spec for instance {instance_uuid} could not be found.")
    return dict(row.spec)


def save_request_spec(session: Session, instance_uuid: str, spec: Mapping[str, Any]) -> None:
    """Store ``spec`` as the request spec of an instance (creating or replacing it)."""
    row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == instance_uuid)).one_or_none()
    if row is None:
        session.add(RequestSpec(instance_uuid=instance_uuid, spec=dict(spec)))
    else:
        row.spec = dict(spec)
    session.flush()


# --- locating and reading servers ------------------------------------------------------------------


def locate(ctx: RequestContext, server_id: str, *, read_deleted: bool = False) -> Location:
    """Find a server through its instance mapping.

    Non-admin callers only find servers of their own project.

    Args:
        read_deleted: also find a deleted server (its mapping queued for delete). Its records
            (the soft-deleted instance row, its actions and events) stay in its cell.

    Raises:
        InstanceNotFound: not a uuid, no such server, deleted (unless ``read_deleted``), or
            another project's.
    """
    uuid = normalize_uuid(server_id)
    if uuid is None:
        raise errors.InstanceNotFound(f"Instance {server_id} could not be found.")
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)).one_or_none()
        if (mapping is None or (mapping.queued_for_delete and not read_deleted)
                or (not ctx.is_admin and mapping.project_id != ctx.project_id)):
            raise errors.InstanceNotFound(f"Instance {server_id} could not be found.")
        return Location(instance_uuid=uuid, project_id=mapping.project_id, user_id=mapping.user_id,
                        cell=mapping.cell)


def _server_from_instance(instance: Instance, cell: str) -> Server:
    return Server(
        uuid=instance.uuid, name=instance.display_name, project_id=instance.project_id, user_id=instance.user_id,
        image_ref=instance.image_ref, flavor=dict(instance.flavor or {}), vm_state=instance.vm_state,
        task_state=instance.task_state, power_state=instance.power_state, created_at=instance.created_at,
        updated_at=instance.updated_at, host=instance.host, node=instance.node, instance_id=instance.id,
        availability_zone=instance.availability_zone, key_name=instance.key_name,
        metadata=dict(instance.metadata_items or {}), locked=bool(instance.locked),
        launched_at=instance.launched_at, terminated_at=instance.terminated_at, cell=cell,
        description=instance.display_description,
        hostname=instance.hostname, reservation_id=instance.reservation_id, user_data=instance.user_data,
        launch_index=instance.launch_index or 0,
    )


def _server_from_build(build: BuildRequest) -> Server:
    fields = build.instance
    return Server(
        uuid=build.instance_uuid, name=fields.get("display_name", ""), project_id=build.project_id,
        user_id=fields.get("user_id", ""), image_ref=fields.get("image_ref"), flavor=dict(fields.get("flavor") or {}),
        vm_state=fields.get("vm_state", states.BUILDING), task_state=fields.get("task_state", states.SCHEDULING),
        power_state=fields.get("power_state", states.NOSTATE), created_at=build.created_at,
        updated_at=build.updated_at, availability_zone=fields.get("availability_zone"),
        key_name=fields.get("key_name"), metadata=dict(fields.get("metadata") or {}),
        locked=bool(fields.get("locked")), tags=list(build.tags or []),
        description=fields.get("display_description"), hostname=fields.get("hostname"),
        reservation_id=fields.get("reservation_id"), user_data=fields.get("user_data"),
        launch_index=fields.get("launch_index") or 0,
        volumes=[{"id": b["volume_id"], "delete_on_termination": bool(b.get("delete_on_termination"))}
                 for b in build.block_device_mappings or [] if b.get("destination_type") == "volume"],
    )


def page_size(limit: int | None) -> int:
    """How many items a page holds: ``limit``, at most :data:`MAX_LIST_LIMIT` (all when None)."""
    return MAX_LIST_LIMIT if limit is None else min(limit, MAX_LIST_LIMIT)


def after_marker(items: list[T], marker: str | None, key: Callable[[T], str], missing: str) -> list[T]:
    """The items after the one whose ``key`` is ``marker`` (all of them when ``marker`` is None):
    the next page of a list paged the way Nova pages.

    Raises:
        BadRequest: no item is the marker (``missing`` is the message).
    """
    if marker is None:
        return items
    index = next((i for i, item in enumerate(items) if key(item) == marker), None)
    if index is None:
        raise errors.BadRequest(missing)
    return items[index + 1:]


def _chunks(items: Sequence[str], size: int = 500) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _by_cell(servers: Iterable[Server]) -> dict[str, dict[str, Server]]:
    """The servers that have a cell, by cell and uuid."""
    found: dict[str, dict[str, Server]] = {}
    for server in servers:
        if server.cell is not None:
            found.setdefault(server.cell, {})[server.uuid] = server
    return found


def _add_zones(servers: Iterable[Server]) -> None:
    """A placed server is in its host's availability zone (one it was asked for stays, as the
    scheduler keeps it there); one not placed yet shows the zone it was asked for, if any."""
    placed = [s for s in servers if s.host]
    zones = aggregates.zones_of_hosts({s.host for s in placed if s.host})
    for server in placed:
        server.availability_zone = zones[server.host or ""]


def _load_tags(session: Session, wanted: Mapping[str, Server], chunk: Sequence[str]) -> None:
    for tag in session.scalars(select(Tag).where(Tag.instance_uuid.in_(chunk)).order_by(Tag.tag)):
        wanted[tag.instance_uuid].tags.append(tag.tag)


def _add_tags(servers: Iterable[Server]) -> None:
    """Fill in the tags of the servers that have a cell (a build request carries its own)."""
    for cell, wanted in _by_cell(servers).items():
        with cell_session(cell) as session:
            for chunk in _chunks(list(wanted)):
                _load_tags(session, wanted, chunk)


def _add_details(servers: list[Server], *, tags: bool = True) -> None:
    """Fill in tags (unless ``tags`` is False: loaded already), faults, volumes (from each
    cell) and ports (from the API database)."""
    for cell, wanted in _by_cell(servers).items():
        with cell_session(cell) as session:
            for chunk in _chunks(list(wanted)):
                if tags:
                    _load_tags(session, wanted, chunk)
                for bdm in session.scalars(select(BlockDeviceMapping).where(
                        BlockDeviceMapping.instance_uuid.in_(chunk), BlockDeviceMapping.deleted.is_(False),
                        BlockDeviceMapping.destination_type == "volume").order_by(BlockDeviceMapping.id)):
                    wanted[bdm.instance_uuid].volumes.append(
                        {"id": bdm.volume_id, "delete_on_termination": bool(bdm.delete_on_termination)})
                # A fault shows on a server in ERROR and on a deleted one (as Nova's view shows it).
                faulted = [u for u in chunk if wanted[u].vm_state in (states.ERROR, states.DELETED)]
                if faulted:
                    faults = session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid.in_(faulted))
                                             .order_by(InstanceFault.created_at, InstanceFault.id))
                    for fault in faults:  # ascending, so the newest fault wins
                        wanted[fault.instance_uuid].fault = {
                            "code": fault.code, "message": fault.message, "details": fault.details,
                            "created": fault.created_at}
    wanted_all = {s.uuid: s for s in servers}
    with api_session() as session:
        for chunk in _chunks(list(wanted_all)):
            rows = session.execute(select(Port, Network.name).join(Network, Network.id == Port.network_id)
                                   .where(Port.device_id.in_(chunk)).order_by(Port.created_at, Port.id))
            for port, network_name in rows:
                wanted_all[str(port.device_id)].ports.append(
                    {"id": port.id, "network_id": port.network_id, "network_name": network_name,
                     "fixed_ip": port.fixed_ip, "mac_address": port.mac_address})
            for uuid, spec in session.execute(select(RequestSpec.instance_uuid, RequestSpec.spec)
                                              .where(RequestSpec.instance_uuid.in_(chunk))):
                wanted_all[uuid].pinned_availability_zone = (spec or {}).get("availability_zone") or None


def _read(location: Location) -> Server | None:
    """The server at ``location`` without details, or None when it is not there (any more)."""
    if location.cell is None:
        with api_session() as session:
            build = session.scalars(select(BuildRequest).where(
                BuildRequest.instance_uuid == location.instance_uuid)).one_or_none()
            return _server_from_build(build) if build is not None else None
    with cell_session(location.cell) as session:
        try:
            instance = instances.get(session, location.instance_uuid)
        except errors.InstanceNotFound:
            return None
        return _server_from_instance(instance, location.cell.name)


def get_server(ctx: RequestContext, server_id: str) -> Server:
    """The server ``server_id`` as the caller may see it.

    A server whose build request was just scheduled is looked up again through its mapping.

    Raises:
        InstanceNotFound: no such server, or another project's (for non-admins).
        DBAPIError: its cell's database does not answer (see :func:`show_server`).
    """
    return cast(Server, show_server(ctx, server_id, unknown=False))


def show_server(ctx: RequestContext, server_id: str, *, unknown: bool) -> Server | UnknownServer:
    """:func:`get_server`, or with ``unknown`` (2.69), when the server's cell does not answer,
    what the API database knows of it (:class:`UnknownServer`), as Nova shows a server of a
    down cell: the flavor is the one it was booted with or last confirmed a move to.

    Raises:
        InstanceNotFound: no such server, or another project's (for non-admins).
        DBAPIError: its cell's database does not answer (without ``unknown``).
    """
    for _attempt in range(2):
        location = locate(ctx, server_id)
        try:
            server = _read(location)
        except DBAPIError as exc:
            if not unknown or location.cell is None or not db.transient(exc):
                raise
            logger.warning("cell database does not answer; the server is shown UNKNOWN",
                           extra={"cell": location.cell.name, "instance_uuid": location.instance_uuid,
                                  "error": type(exc).__name__})
            return _unknown_server(location)
        if server is not None:
            _add_zones([server])
            _add_details([server])
            return server
    raise errors.InstanceNotFound(f"Instance {server_id} could not be found.")


def list_servers(ctx: RequestContext, filters: ServerFilters) -> list[Server]:
    """Servers the caller may see, filtered, ordered and paged like Nova (see
    :mod:`ferry.compute.server_filters`); newest first unless ``filters.sort`` says otherwise.

    Deleted servers are read as ``filters.read_deleted`` says (a deleted server is shown from
    its mapped cell, DELETED). Only the caller's project is listed unless ``filters.all_tenants`` (every project, or
    ``filters.project_id``): the caller must have been allowed that, and the filters meant for
    admins only, by the HTTP layer. A cell whose database does not answer is left out (see
    :func:`list_page` for its servers' partial records).

    Raises:
        BadRequest: a marker that is not in the list.
    """
    return list_page(ctx, filters).servers


def list_page(ctx: RequestContext, filters: ServerFilters, *, unknown: bool = False) -> ServerPage:
    """:func:`list_servers`, and with ``unknown`` (2.69) the servers of the cells whose database
    does not answer as :class:`UnknownServer` records, as Nova's partial records: every server
    mapped to such a cell and not being deleted, of the listed project (or every one), whatever
    the other filters (they cannot be judged without the server), the uuid's excepted; none when
    only deleted servers are listed. In the default order they take their place by when they
    were accepted (their mapping's creation); in another they come after the servers read. A
    marker naming one pages on from its place, whether its cell answers again or not.

    Raises:
        BadRequest: a marker that is not in the list.
    """
    project: str | None = ctx.project_id
    if filters.all_tenants:
        project = filters.project_id or None
    unknown = unknown and filters.read_deleted != "only"
    with api_session() as session:
        flavor_id = None
        if filters.flavor is not None:
            flavor_id = session.scalars(select(Flavor.id).where(Flavor.flavorid == ref_id(filters.flavor))).first()
            if flavor_id is None:
                return ServerPage([])
    if not filters.sort and filters.read_deleted == "no" and filters.uuid is None:
        return ServerPage(_list_newest_first(filters, project, flavor_id, unknown))
    return ServerPage(_list_sorted(filters, project, flavor_id, unknown))


def _list_sorted(filters: ServerFilters, project: str | None, flavor_id: int | None,
                 unknown: bool) -> list[Server | UnknownServer]:
    """:func:`list_page` in any order: every server the caller may see is read, ordered and
    filtered; the unknown ones (``unknown``) come after them."""
    with api_session() as session:
        query = select(InstanceMapping)
        if filters.read_deleted == "no":
            query = query.where(InstanceMapping.queued_for_delete.is_(False))
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        if filters.uuid is not None and not filters.marker:  # the marker is looked up among every server
            query = query.where(InstanceMapping.instance_uuid == filters.uuid)
        mappings = list(session.scalars(query))
        unscheduled = [m.instance_uuid for m in mappings if m.cell is None]
        servers = [_server_from_build(b) for chunk in _chunks(unscheduled)
                   for b in session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid.in_(chunk)))]
    by_cell: dict[int, tuple[CellMapping, list[str]]] = {}
    for mapping in mappings:
        if mapping.cell is not None:
            by_cell.setdefault(mapping.cell.id, (mapping.cell, []))[1].append(mapping.instance_uuid)
    deleted = {"no": (False,), "yes": (False, True), "only": (True,)}[filters.read_deleted]
    down: list[CellMapping] = []
    for cell, uuids in by_cell.values():
        try:
            servers.extend(_listed_in(cell, uuids, deleted))
        except DBAPIError as exc:
            # As Nova lists by default (list_records_by_skipping_down_cells): the servers of a cell
            # whose database does not answer are left out, not the whole list failed.
            db.left_out(exc, cell, "servers", servers=len(uuids))
            down.append(cell)
    size = page_size(filters.limit)
    if filters.marker and not any(server.uuid == filters.marker for server in servers):
        marked = _unknown_position(filters.marker, project, down) if unknown else None
        if marked is not None:  # the page before ended among the unknown servers
            return list(itertools.islice(_unknown_newest_first(down, project, marked, size, filters.uuid), size))
        # Deleted since the page before (or a server the list does not read): as in Nova, the
        # page still starts after its place in the order.
        servers.extend(_deleted_marker(filters.marker, project) or [])
    _add_zones(servers)
    servers = server_filters.order(servers, filters.sort)
    # As in Nova, the marker is found whether or not it passes the filters (it may have changed
    # since the page before), and the page starts after its place in the order.
    servers = after_marker(servers, filters.marker or None, lambda s: s.uuid, f"marker [{filters.marker}] not found")
    if filters.by_tags:
        _add_tags(servers)
    addresses = _fixed_addresses([s.uuid for s in servers]) if filters.by_address else None
    page = list(itertools.islice((s for s in servers if server_filters.matches(
        s, filters, flavor_id=flavor_id, addresses=addresses)), size))
    _add_details(page, tags=not filters.by_tags)
    listed: list[Server | UnknownServer] = list(page)
    if unknown and down and len(page) < size:
        shown = {s.uuid for s in page}
        listed += itertools.islice((u for u in _unknown_newest_first(down, project, None, size, filters.uuid)
                                    if u.uuid not in shown), size - len(page))
    return listed


# How many servers a newest-first list reads from a cell at a time (see _newest_first_in).
_LIST_BATCH = 500

_Position = tuple[dt.datetime, str]


def _list_newest_first(filters: ServerFilters, project: str | None, flavor_id: int | None,
                       unknown: bool) -> list[Server | UnknownServer]:
    """:func:`list_page` in its default order (newest first, no deleted servers, no uuid): each
    cell's servers are read newest first from the marker's place on, a batch at a time (the first
    no larger than the page), merged, and filtered until the page is full. A page then reads
    about its size from each cell when most servers pass the filters, however many servers there
    are (a filter few pass reads on until the page fills, up to every server after the marker);
    the general path read every server for each page, so listing them all grew quadratically.
    The servers listed, their order and the marker's meaning are those of the general path; a
    server that changes cell while the page is read (scheduled, or a move between cells
    switching) is listed once. With ``unknown``, the servers of the cells that did not answer
    are merged in by their mapping's creation, after the servers read at the same moment.

    Raises:
        BadRequest: a marker that is not in the list.
    """
    size = page_size(filters.limit)
    after = _marker_position(filters.marker, project, unknown) if filters.marker else None
    first = max(1, min(size, _LIST_BATCH))
    down: list[CellMapping] = []
    streams: list[Iterable[Server | UnknownServer]] = [
        _newest_first_in(cell, project, after, first, down) for cell in db.all_cells()]
    streams.append(iter(_builds_newest_first(project, after)))
    if unknown:
        # Last: the merge asks every stream for its first server in their order, so the cells have
        # been read (and those that did not answer named in ``down``) when this one is asked.
        streams.append(_unknown_newest_first(down, project, after, first, None))
    # A cell's copy comes before a build request's of the same server (merge keeps the streams'
    # order among equal keys), and one server is listed once.
    merged = _once_each(heapq.merge(*streams, key=_position, reverse=True))
    page: list[Server | UnknownServer] = []
    while len(page) < size:
        chunk = list(itertools.islice(merged, max(1, min(size - len(page), _LIST_BATCH))))
        if not chunk:
            break
        read = [s for s in chunk if isinstance(s, Server)]
        _add_zones(read)
        if filters.by_tags:
            _add_tags(read)
        addresses = _fixed_addresses([s.uuid for s in read]) if filters.by_address else None
        page += itertools.islice((s for s in chunk if isinstance(s, UnknownServer) or server_filters.matches(
            s, filters, flavor_id=flavor_id, addresses=addresses)), size - len(page))
    _add_details([s for s in page if isinstance(s, Server)], tags=not filters.by_tags)
    return page


_Listed = TypeVar("_Listed", Server, UnknownServer, Server | UnknownServer)


def _once_each(servers: Iterable[_Listed]) -> Iterator[_Listed]:
    """``servers`` without the later copies of one already given."""
    seen: set[str] = set()
    for server in servers:
        if server.uuid not in seen:
            seen.add(server.uuid)
            yield server


def _position(server: Server | UnknownServer) -> _Position:
    """Where a server stands in the default order (newest first, then the greater uuid); an
    unknown one by when it was accepted."""
    return server.created_at, server.uuid


def _marker_position(marker: str, project: str | None, unknown: bool) -> _Position:
    """The place of the server ``marker`` (of ``project`` unless None) in the default order,
    whether or not it passes the filters, and also once deleted (see :func:`list_servers`).
    With ``unknown``, a server whose cell does not answer is placed by its mapping's creation
    (where it is listed UNKNOWN).

    Raises:
        BadRequest: no such server (or another project's), or its cell does not answer (without
            ``unknown``).
    """
    with api_session() as session:
        query = select(InstanceMapping).where(InstanceMapping.instance_uuid == marker)
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        mapping = session.scalars(query).one_or_none()
        cell = mapping.cell if mapping is not None else None
        if mapping is not None and cell is None and not mapping.queued_for_delete:
            build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == marker)).one_or_none()
            if build is not None:
                return build.created_at, marker
    if mapping is not None and cell is not None and not mapping.queued_for_delete:
        try:
            with cell_session(cell) as session:  # by uuid alone (its unique index), the copy picked here
                created = next((at for at, hidden, deleted in session.execute(
                    select(Instance.created_at, Instance.hidden, Instance.deleted).where(Instance.uuid == marker))
                    if not hidden and not deleted), None)
        except DBAPIError as exc:
            if not db.transient(exc):
                raise
            if unknown:
                return mapping.created_at, marker
            created = None  # its cell does not answer: not found, as when the list leaves that cell out
        if created is not None:
            return created, marker
    deleted = _deleted_marker(marker, project)
    if deleted is None and unknown and mapping is not None:  # being deleted in a cell that does not answer
        return mapping.created_at, marker
    if not deleted:
        raise errors.BadRequest(f"marker [{marker}] not found")
    return _position(deleted[0])


def _newest_first_in(cell: CellMapping, project: str | None, after: _Position | None,
                     batch: int, down: list[CellMapping]) -> Iterator[Server]:
    """The servers listed from ``cell`` (its visible copies of servers mapped to it and not being
    deleted, of ``project`` unless None), newest first, after ``after``; read ``batch`` first,
    then :data:`_LIST_BATCH` at a time, each in a session of its own. A cell that does not answer
    ends its part of the list (logged, and added to ``down``), as the general path leaves it out."""
    while True:
        query = select(Instance).where(Instance.deleted.is_(False), Instance.hidden.is_(False))
        if project is not None:
            query = query.where(Instance.project_id == project)
        if after is not None:
            query = query.where(tuple_(Instance.created_at, Instance.uuid) < tuple_(*after))
        try:
            with cell_session(cell) as session:
                rows = [_server_from_instance(row, cell.name) for row in session.scalars(
                    query.order_by(Instance.created_at.desc(), Instance.uuid.desc()).limit(batch))]
        except DBAPIError as exc:
            db.left_out(exc, cell, "servers")
            down.append(cell)
            return
        if not rows:
            return
        mapped = _mapped_to(cell, project, [server.uuid for server in rows])
        yield from (server for server in rows if server.uuid in mapped)
        if len(rows) < batch:
            return
        after, batch = _position(rows[-1]), _LIST_BATCH


def _unknown_server(location: Location) -> UnknownServer:
    """The server at ``location`` as its mapping and request spec know it."""
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(
            InstanceMapping.instance_uuid == location.instance_uuid)).one_or_none()
        row = session.scalars(select(RequestSpec).where(
            RequestSpec.instance_uuid == location.instance_uuid)).one_or_none()
    if mapping is None:  # deleted since it was located
        raise errors.InstanceNotFound(f"Instance {location.instance_uuid} could not be found.")
    spec = dict(row.spec or {}) if row is not None else {}
    image = (spec.get("image") or {}).get("id") if not spec.get("is_bfv") else ""
    return UnknownServer(location.instance_uuid, mapping.project_id, mapping.created_at, user_id=mapping.user_id,
                         flavor=dict(spec.get("flavor") or {}), image_ref=image,
                         availability_zone=spec.get("availability_zone"))


def _unknown_newest_first(cells: list[CellMapping], project: str | None, after: _Position | None, batch: int,
                          uuid: str | None) -> Iterator[UnknownServer]:
    """The servers mapped to ``cells`` and not being deleted (of ``project`` unless None, only
    ``uuid`` unless None) as :class:`UnknownServer` records, newest mapping first, after
    ``after``; read when first asked for, ``batch`` first, then :data:`_LIST_BATCH` at a time."""
    yield from heapq.merge(*(_unknown_in(cell, project, after, batch, uuid) for cell in cells),
                           key=_position, reverse=True)


def _unknown_in(cell: CellMapping, project: str | None, after: _Position | None, batch: int,
                uuid: str | None) -> Iterator[UnknownServer]:
    """:func:`_unknown_newest_first` for one cell (API migration 0012 indexes the read)."""
    while True:
        query = select(InstanceMapping.instance_uuid, InstanceMapping.project_id, InstanceMapping.created_at).where(
            InstanceMapping.cell_id == cell.id, InstanceMapping.queued_for_delete.is_(False))
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        if uuid is not None:
            query = query.where(InstanceMapping.instance_uuid == uuid)
        if after is not None:
            query = query.where(tuple_(InstanceMapping.created_at, InstanceMapping.instance_uuid) < tuple_(*after))
        with api_session() as session:
            rows = [UnknownServer(*row) for row in session.execute(query.order_by(
                InstanceMapping.created_at.desc(), InstanceMapping.instance_uuid.desc()).limit(batch))]
        yield from rows
        if len(rows) < batch:
            return
        after, batch = _position(rows[-1]), _LIST_BATCH


def _unknown_position(marker: str, project: str | None, down: list[CellMapping]) -> _Position | None:
    """Where the server ``marker`` (of ``project`` unless None) stands among the unknown servers
    when it is mapped to one of the cells ``down``; None otherwise."""
    with api_session() as session:
        query = select(InstanceMapping.cell_id, InstanceMapping.created_at).where(
            InstanceMapping.instance_uuid == marker)
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        row = session.execute(query).one_or_none()
    if row is None or row.cell_id not in {cell.id for cell in down}:
        return None
    return row.created_at, marker


def _mapped_to(cell: CellMapping, project: str | None, uuids: Sequence[str]) -> set[str]:
    """Which of ``uuids`` are mapped to ``cell`` (of ``project`` unless None) and not being deleted."""
    with api_session() as session:
        # Read by uuid alone, and the rest compared here: a condition on the cell or the delete
        # flag can make the database scan every mapping of the cell rather than look these up.
        rows = session.execute(select(InstanceMapping.instance_uuid, InstanceMapping.cell_id,
                                      InstanceMapping.queued_for_delete, InstanceMapping.project_id)
                               .where(InstanceMapping.instance_uuid.in_(uuids)))
        return {uuid for uuid, cell_id, queued, owner in rows
                if cell_id == cell.id and not queued and (project is None or owner == project)}


def _builds_newest_first(project: str | None, after: _Position | None) -> list[Server]:
    """The servers not scheduled yet (build requests, of ``project`` unless None), newest first, after ``after``."""
    with api_session() as session:
        query = select(BuildRequest).join(
            InstanceMapping, InstanceMapping.instance_uuid == BuildRequest.instance_uuid).where(
            InstanceMapping.cell_id.is_(None), InstanceMapping.queued_for_delete.is_(False))
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        builds = [_server_from_build(build) for build in session.scalars(query)]
    return sorted((b for b in builds if after is None or _position(b) < after), key=_position, reverse=True)


def _listed_in(cell: CellMapping, uuids: list[str], deleted: tuple[bool, ...]) -> list[Server]:
    """The visible records in ``cell`` of the servers ``uuids``, deleted or not as ``deleted`` says."""
    found: list[Server] = []
    with cell_session(cell) as session:
        for chunk in _chunks(uuids):
            rows = session.scalars(select(Instance).where(
                Instance.uuid.in_(chunk), Instance.deleted.in_(deleted), Instance.hidden.is_(False)))
            found.extend(_server_from_instance(row, cell.name) for row in rows)
    return found


def _deleted_marker(marker: str, project: str | None) -> list[Server] | None:
    """The deleted server ``marker`` names (of ``project`` unless None), as a list to page after;
    empty when there is none, None when its cell does not answer."""
    with api_session() as session:
        query = select(InstanceMapping).where(InstanceMapping.instance_uuid == marker,
                                              InstanceMapping.queued_for_delete.is_(True))
        if project is not None:
            query = query.where(InstanceMapping.project_id == project)
        mapping = session.scalars(query).one_or_none()
        cell = mapping.cell if mapping is not None else None
    if cell is None:
        return []
    try:
        with cell_session(cell) as session:
            row = session.scalars(select(Instance).where(Instance.uuid == marker, Instance.hidden.is_(False))).first()
            return [] if row is None else [_server_from_instance(row, cell.name)]
    except DBAPIError as exc:
        if not db.transient(exc):
            raise
        return None  # its cell does not answer


def _fixed_addresses(uuids: Sequence[str]) -> dict[str, list[str]]:
    """Each server's fixed addresses (from its ports)."""
    found: dict[str, list[str]] = {}
    with api_session() as session:
        for chunk in _chunks(uuids):
            for device_id, fixed_ip in session.execute(select(Port.device_id, Port.fixed_ip).where(
                    Port.device_id.in_(chunk), Port.fixed_ip.is_not(None))):
                found.setdefault(str(device_id), []).append(str(fixed_ip))
    return found


# --- creating servers ------------------------------------------------------------------------------


def _bootable_flavor(session: Session, ctx: RequestContext, flavor_ref: str) -> Flavor:
    flavor = session.scalars(select(Flavor).where(Flavor.flavorid == ref_id(flavor_ref))).one_or_none()
    if flavor is None or flavor.disabled or not flavor_access.usable(ctx, flavor):
        raise errors.BadRequest("Invalid flavorRef provided.")
    return flavor


def _requested_destination(ctx: RequestContext, request: BootRequest) -> dict[str, str] | None:
    """The host and node a create asks for, checked (None when it names neither).

    Raises:
        Forbidden: the caller may not choose where a server lands (admins only by default).
        BadRequest: no such compute host, or a node that is not the named host's.
    """
    host, node = request.requested_host, request.requested_node
    if host is None and node is None:
        return None
    policy.enforce(ctx, "compute:servers:create:requested_destination", {"project_id": ctx.project_id})
    if host is not None and not hosts.is_compute_host(host):
        raise errors.BadRequest(f"Compute host {host} could not be found.")
    if node is not None:
        node_host = placement.host_of_node(node)
        if node_host is None or (host is not None and node_host != host):
            raise errors.BadRequest(f"Compute node {node} could not be found"
                                    + (f" on host {host}." if host is not None else "."))
    return {key: value for key, value in (("host", host), ("node", node)) if value is not None}


def _bootable_image(ctx: RequestContext, image_id: str) -> dict[str, Any]:
    try:
        image = images.get_image(image_id)
    except errors.ImageNotFound as exc:
        raise errors.BadRequest("Can not find requested image") from exc
    if not images.visible_to(image, ctx.project_id, is_admin=ctx.is_admin):
        raise errors.BadRequest("Can not find requested image")
    if image["status"] != images.ACTIVE:
        raise errors.BadRequest(f"Image {image_id} is not active.")
    return image


def _is_local_image_root(bdm: dict[str, Any]) -> bool:
    """A mapping that only restates an image-backed root (image to a local disk, boot index 0).

    ``openstack server create --image`` sends one beside ``imageRef``; Nova treats it as the
    ordinary image-backed boot, and so does Ferry.
    """
    return (bdm.get("source_type") == "image" and bdm.get("destination_type") == "local"
            and str(bdm.get("boot_index")) == "0" and bool(bdm.get("uuid")))


def _local_image_root(request: BootRequest) -> str | None:
    """The image a local-root mapping names, if the request carries one."""
    for bdm in request.block_device_mapping:
        if _is_local_image_root(bdm):
            return str(bdm["uuid"])
    return None


def _root_device(request: BootRequest) -> dict[str, Any] | None:
    """The volume-backed root the request asks for, normalised, or None for an image-backed server."""
    bdms = [bdm for bdm in request.block_device_mapping if not _is_local_image_root(bdm)]
    if not bdms:
        return None
    if len(bdms) < len(request.block_device_mapping):
        raise errors.BadRequest("A server has one root disk: an image-backed root and a root volume conflict.")
    if len(bdms) > 1:
        raise errors.BadRequest("Only one block device mapping, the root volume, is supported.")
    bdm = bdms[0]
    source, destination = bdm.get("source_type"), bdm.get("destination_type", "volume")
    if str(bdm.get("boot_index")) != "0":
        raise errors.BadRequest("The block device mapping must be the root disk (boot_index 0).")
    if destination != "volume" or source not in ("image", "volume") or not bdm.get("uuid"):
        raise errors.BadRequest("Only a root volume created from an image (source_type image, destination_type "
                                "volume) or an existing volume (source_type volume) is supported.")
    if source == "image" and not bdm.get("volume_size"):
        raise errors.BadRequest("volume_size is required to create a root volume from an image.")
    if bdm.get("volume_size") and not 1 <= int(bdm["volume_size"]) <= validation.MAX_INT:
        raise errors.BadRequest(f"Invalid input for field/attribute volume_size. Value: {bdm['volume_size']}. "
                                f"It must be from 1 to {validation.MAX_INT}")
    device = bdm.get("device_name")
    return {
        "source_type": source,
        "uuid": str(bdm["uuid"]),
        "volume_size": int(bdm["volume_size"]) if bdm.get("volume_size") else None,
        "delete_on_termination": bool(bdm.get("delete_on_termination", False)),
        "device_name": device.removeprefix("/dev/") if device else None,
        "tag": bdm.get("tag"),
    }


def check_image_fits(image: dict[str, Any], memory_mb: int, root_gb: int, root: dict[str, Any] | None = None) -> None:
    """Refuse (400) a boot, or a resize of an image-backed server, whose flavor (``memory_mb``,
    ``root_gb``) or new root volume cannot hold the image: its minimums, and its disk's size (the
    virtual size of a sparse image), as Nova does before anything is built or moved."""
    if memory_mb < image["min_ram"]:
        raise errors.BadRequest("Flavor's memory is too small for requested image.")
    image_bytes = int(image.get("virtual_size") or image.get("size") or 0)
    if root is not None:
        if root["source_type"] == "image" and root["volume_size"] < image["min_disk"]:
            raise errors.BadRequest("Volume is smaller than the minimum size specified in image metadata.")
        if root["source_type"] == "image" and root["volume_size"] * protocol.GiB < image_bytes:
            raise errors.BadRequest(f"Volume is smaller than the requested image. Volume size is "
                                    f"{root['volume_size'] * protocol.GiB} bytes, image is {image_bytes} bytes.")
        return
    if root_gb and root_gb < image["min_disk"]:
        raise errors.BadRequest("Flavor's disk is too small for requested image.")
    if root_gb and root_gb * protocol.GiB < image_bytes:
        raise errors.BadRequest(f"Flavor's disk is too small for requested image. Flavor disk is "
                                f"{root_gb * protocol.GiB} bytes, image is {image_bytes} bytes.")


def _new_mac(session: Session) -> str:
    for _attempt in range(32):
        mac = MAC_PREFIX + "".join(f":{b:02x}" for b in secrets.token_bytes(3))
        if session.scalars(select(Port.id).where(Port.mac_address == mac)).first() is None:
            return mac
    raise errors.Conflict("Could not generate a unique MAC address.")


def _allocate_ip(session: Session, network: Network, requested: str | None = None) -> str:
    """A free fixed IP on ``network`` (the requested one if given); the first host address is the gateway."""
    # Lock the network row so concurrent boots on PostgreSQL do not hand out the same address.
    session.execute(select(Network.id).where(Network.id == network.id).with_for_update())
    subnet = ipaddress.ip_network(network.cidr, strict=False)
    used = set(session.scalars(select(Port.fixed_ip).where(Port.network_id == network.id,
                                                            Port.fixed_ip.is_not(None))))
    candidates = itertools.islice(subnet.hosts(), 1, None)
    if requested is not None:
        try:
            address = ipaddress.ip_address(requested)
        except ValueError as exc:
            raise errors.BadRequest(f"Invalid fixed IP address {requested}.") from exc
        if address not in subnet or address in (subnet.network_address, subnet.broadcast_address):
            raise errors.BadRequest(f"Fixed IP {requested} is not a valid address on network {network.id}.")
        if str(address) in used:
            # 400, as Nova answers a fixed IP already in use at create.
            raise errors.BadRequest(f"Fixed IP address {requested} is already in use on network {network.id}.")
        return str(address)
    for candidate in candidates:
        if str(candidate) not in used:
            return str(candidate)
    raise errors.Conflict(f"No more IP addresses available on network {network.id}.")


def _shared_network(session: Session) -> Network:
    """The shared network ``auto`` attaches to, created on first use."""
    network = session.scalars(select(Network).where(Network.name == SHARED_NETWORK_NAME, Network.shared.is_(True))
                              .order_by(Network.created_at)).first()
    if network is not None:
        return network
    try:
        with session.begin_nested():
            session.add(Network(id=SHARED_NETWORK_ID, name=SHARED_NETWORK_NAME, cidr=SHARED_NETWORK_CIDR,
                                shared=True, project_id=None))
    except IntegrityError:
        pass  # another boot created it first
    network = session.get(Network, SHARED_NETWORK_ID)
    if network is None:
        raise errors.Conflict("The shared network could not be created.")
    return network


def _network_for(session: Session, ctx: RequestContext, network_id: str) -> Network:
    network = session.get(Network, network_id)
    if network is None or not (network.shared or network.project_id == ctx.project_id or ctx.is_admin):
        raise errors.BadRequest(f"Network {network_id} could not be found.")
    return network


def _allocate_ports(session: Session, ctx: RequestContext, instance_uuid: str,
                    networks: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create or claim the server's ports; returns the request spec's ``requested_networks``."""
    if networks == NETWORKS_NONE:
        return []
    if isinstance(networks, str):  # "auto"
        wanted: list[dict[str, Any]] = [{"uuid": _shared_network(session).id}]
    else:
        wanted = list(networks)
    requested: list[dict[str, Any]] = []
    for item in wanted:
        if item.get("port"):
            port = session.get(Port, item["port"])
            if port is None or (port.project_id != ctx.project_id and not ctx.is_admin):
                raise errors.BadRequest(f"Port id {item['port']} could not be found.")
            # Claimed by one statement: of two boots given the same port at once, one gets it.
            claimed = session.execute(update(Port).where(Port.id == port.id, Port.device_id.is_(None))
                                      .values(device_id=instance_uuid))
            if cast(CursorResult[Any], claimed).rowcount != 1:
                raise errors.Conflict(f"Port {port.id} is still in use.")
            requested.append(_tagged({"network_id": port.network_id, "port_id": port.id, "preexisting": True},
                                     item))
            continue
        network = _network_for(session, ctx, item["uuid"])
        if item.get("fixed_ip") and not ctx.is_admin and network.project_id != ctx.project_id:
            # As Neutron's default policy (create_port:fixed_ips:ip_address): on a network another
            # project shares, a member would otherwise learn, and take, the addresses of others.
            raise errors.Forbidden("Only administrators and the network's owner may choose a fixed IP on "
                                   f"network {network.id}.")
        port = Port(network_id=network.id, project_id=ctx.project_id, device_id=instance_uuid,
                    mac_address=_new_mac(session), fixed_ip=_allocate_ip(session, network, item.get("fixed_ip")))
        session.add(port)
        session.flush()
        requested.append(_tagged({"network_id": network.id, "port_id": port.id, "preexisting": False}, item))
    return requested


def _tagged(entry: dict[str, Any], requested: Mapping[str, Any]) -> dict[str, Any]:
    """A requested network's entry, with the device tag it was asked with (2.32–2.36 and from 2.42)."""
    return {**entry, "tag": requested["tag"]} if requested.get("tag") else entry


def _reserve_root_volume(session: Session, ctx: RequestContext, instance_uuid: str,
                         root: dict[str, Any]) -> dict[str, Any]:
    """Create (from an image) or reserve (existing) the root volume; returns its block device mapping."""
    if root["source_type"] == "image":
        volume_id = str(uuidlib.uuid4())
        session.add(Volume(id=volume_id, name=f"{instance_uuid}{volume_store.ROOT_VOLUME_SUFFIX}",
                           project_id=ctx.project_id, size_gb=root["volume_size"], status=volume_store.RESERVED,
                           image_id=root["uuid"],
                           path=str(config.get().state_dir / protocol.VOLUMES_DIR / volume_id)))
        image_id: str | None = root["uuid"]
    else:
        volume = session.get(Volume, root["uuid"])
        if volume is None or (volume.project_id != ctx.project_id and not ctx.is_admin):
            raise errors.BadRequest(f"Volume {root['uuid']} could not be found.")
        # One statement: another boot, an attach or ``ferry volume forget`` may be at it too.
        reserved = session.execute(update(Volume).where(
            Volume.id == volume.id, Volume.status == volume_store.AVAILABLE,
            volume_store.unheld()).values(status=volume_store.RESERVED)
            .execution_options(synchronize_session=False))
        if cast("CursorResult[Any]", reserved).rowcount != 1:
            now = session.scalars(select(Volume.status).where(Volume.id == volume.id)).one_or_none()
            raise errors.BadRequest(f"Volume {volume.id} is not available (status {now or 'gone'}, "
                                    f"or a server holds it).")
        volume_id, image_id = volume.id, None
    session.flush()
    attachment = VolumeAttachment(volume_id=volume_id, instance_uuid=instance_uuid, status=volume_store.RESERVED)
    session.add(attachment)
    session.flush()
    return {"uuid": str(uuidlib.uuid4()), "source_type": root["source_type"], "destination_type": "volume",
            "boot_index": 0, "volume_id": volume_id, "image_id": image_id, "volume_size": root["volume_size"],
            "device_name": root["device_name"], "delete_on_termination": root["delete_on_termination"],
            "attachment_id": attachment.id, "tag": root["tag"]}


def _scheduler_hints(hints: Mapping[str, Any]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for key in ("same_host", "different_host"):
        value = hints.get(key)
        if value:
            result[key] = [value] if isinstance(value, str) else [str(v) for v in value]
    return result


# The most servers one create makes (a larger max_count makes this many, as a quota would limit it).
MAX_SERVERS_PER_CREATE = 100


def create_server(ctx: RequestContext, request: BootRequest) -> str:
    """Accept one new server (see :func:`create_servers`); returns its id."""
    return create_servers(ctx, request)[0]


def _refuse_multiple(request: BootRequest, root: dict[str, Any] | None) -> None:
    """Refuse what one create cannot give several servers: a port, a fixed IP, a volume, a
    hostname; and more servers at least than one request makes.

    Raises:
        BadRequest: ``min_count`` above :data:`MAX_SERVERS_PER_CREATE`, or ``max_count`` above 1
            and the request names one of them.
    """
    if request.min_count > MAX_SERVERS_PER_CREATE:
        raise errors.BadRequest(f"min_count may be at most {MAX_SERVERS_PER_CREATE}: one request creates at most "
                                f"{MAX_SERVERS_PER_CREATE} servers.")
    if request.max_count <= 1:
        return
    networks = request.networks if isinstance(request.networks, list) else []
    if any(item.get("port") for item in networks):
        raise errors.BadRequest("Unable to launch multiple instances with a single configured port ID. "
                                "Please launch your instance one by one with different ports.")
    if any(item.get("fixed_ip") for item in networks):
        raise errors.BadRequest("max_count cannot be greater than 1 if an fixed_ip is specified.")
    if root is not None and root["source_type"] == "volume":
        raise errors.BadRequest("Cannot attach one or more volumes to multiple instances")
    if request.hostname:
        raise errors.BadRequest("Cannot set the hostname of more than one server: leave it out, and each server "
                                "gets one made from its name.")


def _default_hostname(name: str, uuid: str, index: int, count: int) -> str:
    """The hostname of server ``index`` of ``count`` made from the request's ``name``: as one
    server's, with ``-<index + 1>`` after it when there are several (the name made a hostname
    first and cut to leave room for the number, so that no two are the same)."""
    base = instances.default_hostname(name, uuid)
    if count == 1 or base.startswith("Server-"):  # Server-<uuid>: each server's own already
        return base
    suffix = f"-{index + 1}"
    return base[:instances.HOSTNAME_LENGTH - len(suffix)].rstrip(".-") + suffix


def create_servers(ctx: RequestContext, request: BootRequest) -> list[str]:
    """Accept new servers and start a boot workflow for each; returns their ids, in launch order.

    ``request.min_count`` to ``request.max_count`` servers: as many as the project's quota
    leaves room for, at least ``min_count`` (Nova's multiple create), and at most
    :data:`MAX_SERVERS_PER_CREATE` (each is written and its workflow started before the API
    answers, which must be within API Gateway's 29 s). Several servers share
    the request's reservation id and are named ``<name>-1``, ``<name>-2``… (Nova's
    ``multi_instance_display_name_template``).

    Nothing is written when a check fails. When a workflow cannot be started, that server's
    records and those of the servers after it are removed again; the servers before it boot,
    and they are the answer when there are at least ``min_count`` of them, else the error is
    raised.

    Raises:
        BadRequest: unknown or disabled flavor, unknown image, an unsupported block device
            mapping, an unknown network, port or volume, an image that does not fit, an
            unknown server group, a fixed IP already in use, or more than one server with a
            port, a fixed IP, a volume or a hostname.
        Forbidden: an image-backed server on a zero-disk flavor without the policy for it.
        OverQuota: the project's instances, cores or RAM would go over its quota with
            ``min_count`` servers, or the caller's servers in the ``group`` hint's server group
            over ``server_group_members`` (403).
        Conflict: a port already in use, a network out of addresses.
    """
    root = _root_device(request)
    _refuse_multiple(request, root)
    if request.availability_zone and request.availability_zone not in services.available_zones():
        raise errors.BadRequest("The requested availability zone is not available")
    destination = _requested_destination(ctx, request)
    with api_session() as session:
        flavor = _bootable_flavor(session, ctx, request.flavor_ref)
        snapshot = flavor_snapshot(flavor)
    image_id = ref_id(request.image_ref) if request.image_ref else _local_image_root(request)
    local_image = _local_image_root(request)
    if local_image is not None and image_id != local_image:
        raise errors.BadRequest(f"The root block device mapping names image {local_image}, imageRef {image_id}.")
    if root is not None and root["source_type"] == "image":
        image_id = root["uuid"]
    elif root is not None:
        image_id = None
    if root is None and not image_id:
        raise errors.BadRequest("Missing imageRef attribute")
    if image_id:
        check_image_fits(_bootable_image(ctx, image_id), flavor.memory_mb, flavor.root_gb, root)
    if root is None and flavor.root_gb == 0:
        policy.enforce(ctx, "os_compute_api:servers:create:zero_disk_flavor", {"project_id": ctx.project_id})
    each = {quotas.INSTANCES: 1, quotas.CORES: flavor.vcpus, quotas.RAM: flavor.memory_mb}
    count = quotas.servers_that_fit(ctx.project_id, each, request.min_count,
                                    min(request.max_count, MAX_SERVERS_PER_CREATE))
    deltas = {resource: amount * count for resource, amount in each.items()}

    uuids = [str(uuidlib.uuid4()) for _ in range(count)]
    reservation_id = request.reservation_id or instances.new_reservation_id()
    group_hint = request.scheduler_hints.get("group")
    with api_session() as session:
        for index, uuid in enumerate(uuids):
            name = request.name if count == 1 else f"{request.name}-{index + 1}"
            instance = {
                "display_name": name, "display_description": request.description,
                "hostname": request.hostname or _default_hostname(request.name, uuid, index, count),
                "reservation_id": reservation_id, "launch_index": index, "user_data": request.user_data,
                "project_id": ctx.project_id, "user_id": ctx.user_id, "image_ref": image_id if root is None else "",
                "flavor": snapshot, "vm_state": states.BUILDING,
                "task_state": states.SCHEDULING, "power_state": states.NOSTATE,
                "availability_zone": request.availability_zone, "key_name": request.key_name,
                "metadata": dict(request.metadata), "locked": False,
            }
            # One moment for the mapping and the build request (whose time the instance keeps): a
            # server whose cell does not answer is listed in its place by its mapping's (2.69).
            accepted = utcnow()
            session.add(InstanceMapping(instance_uuid=uuid, cell_id=None, project_id=ctx.project_id,
                                        user_id=ctx.user_id, created_at=accepted))
            requested_networks = _allocate_ports(session, ctx, uuid, request.networks)
            if root is None:
                local_tag = next((b.get("tag") for b in request.block_device_mapping if _is_local_image_root(b)),
                                 None)
                bdms = [{"uuid": str(uuidlib.uuid4()), "source_type": "image", "destination_type": "local",
                         "boot_index": 0, "image_id": image_id, "delete_on_termination": True, "tag": local_tag}]
            else:
                bdms = [_reserve_root_volume(session, ctx, uuid, root)]
            group = None
            if group_hint:
                group = server_groups.add_member(session, ctx, normalize_uuid(str(group_hint)) or str(group_hint),
                                                 uuid)
            session.add(BuildRequest(instance_uuid=uuid, project_id=ctx.project_id, instance=instance,
                                     block_device_mappings=bdms, tags=list(dict.fromkeys(request.tags)),
                                     created_at=accepted))
            save_request_spec(session, uuid, {
                "instance_uuid": uuid, "project_id": ctx.project_id, "user_id": ctx.user_id, "flavor": snapshot,
                "image": {"id": image_id}, "is_bfv": root is not None, "ignore_hosts": [],
                "requested_destination": destination, "allowed_cells": None,
                "scheduler_hints": _scheduler_hints(request.scheduler_hints), "group": group,
                "availability_zone": request.availability_zone, "requested_networks": requested_networks,
            })
    try:
        quotas.recheck(ctx.project_id, deltas)
    except Exception:
        # A concurrent boot took the room (OverQuota), or the count could not be made (the API
        # database out of reach, say: a cell's is left out of it): no workflow would ever take the build requests.
        _discard_builds(uuids)
        raise
    for index, uuid in enumerate(uuids):
        try:
            workflows.start_execution(config.get().boot_state_machine_arn, execution_name("boot", uuid),
                                      {"instance_uuid": uuid, "request_id": ctx.request_id})
        except Exception:
            logger.exception("boot workflow did not start; discarding the build requests not started",
                             extra={"instance_uuid": uuid, "started": uuids[:index]})
            _discard_builds(uuids[index:])
            if index and index >= request.min_count:
                return uuids[:index]  # as many as could be made, and at least min_count: the request stands
            raise
        logger.info("server accepted", extra={"instance_uuid": uuid, "flavor": snapshot["flavorid"],
                                              "reservation_id": reservation_id})
    return uuids


def _discard_builds(uuids: Iterable[str]) -> None:
    """Discard the build requests of servers accepted and never started, each whatever became of
    the others (one that cannot be discarded is logged: ``ferry audit`` reports what is left)."""
    for uuid in uuids:
        try:
            _discard_build(uuid, forget=True)
        except Exception:
            logger.exception("build request not discarded", extra={"instance_uuid": uuid})


# --- releasing what a server holds --------------------------------------------------------------------


def _release_unbuilt_volumes(session: Session, instance_uuid: str, bdms: Iterable[Mapping[str, Any]]) -> None:
    """Undo :func:`_reserve_root_volume` for a server that never reached a host."""
    created = {b["volume_id"] for b in bdms if b.get("source_type") == "image" and b.get("volume_id")}
    for attachment in session.scalars(select(VolumeAttachment).where(VolumeAttachment.instance_uuid == instance_uuid)):
        volume = session.get(Volume, attachment.volume_id)
        session.delete(attachment)
        if volume is None:
            continue
        if volume.id in created:
            session.delete(volume)  # never written to disk: the host creates it while spawning
        else:
            volume.status = volume_store.AVAILABLE
    session.flush()


def _discard_build(instance_uuid: str, *, forget: bool) -> bool:
    """Remove a server that is still a build request; False when it no longer is one.

    ``forget`` also drops its mapping and request spec (the server was never accepted);
    otherwise the mapping is queued for delete, as for any deleted server.
    """
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == instance_uuid)
                                ).one_or_none()
        if build is None:
            return False
        bdms = list(build.block_device_mappings or [])
        removed = cast("CursorResult[Any]", session.execute(
            delete(BuildRequest).where(BuildRequest.instance_uuid == instance_uuid)))
        if removed.rowcount != 1:
            return False  # the boot workflow took it into a cell meanwhile
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == instance_uuid)).one_or_none()
        network.release_ports(session, instance_uuid, (spec.spec.get("requested_networks") or []) if spec else [])
        _release_unbuilt_volumes(session, instance_uuid, bdms)
        server_groups.remove_member(session, instance_uuid)
        mapping = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid == instance_uuid)
                                  ).one_or_none()
        if forget:
            if spec is not None:
                session.delete(spec)
            if mapping is not None:
                session.delete(mapping)
        elif mapping is not None:
            mapping.queued_for_delete = True
    return True


# --- delete, stop, start ---------------------------------------------------------------------------


def _check_unlocked(ctx: RequestContext, instance: Instance) -> None:
    if instance.locked and not ctx.is_admin:
        raise errors.InstanceIsLocked(f"Instance {instance.uuid} is locked")


def _undo(cell: CellMapping, instance_uuid: str, request_id: str, undo: dict[str, Any] | None,
          undo_from: str, *, unless_begun: bool = False) -> bool:
    """Put back the task state an accepted request set, and forget its action; whether it did.

    ``unless_begun`` leaves both when the request's workflow recorded an event: its first step
    takes the request under the server's row lock (:func:`actions.take_request`), as this does.
    """
    with cell_session(cell) as session:
        if unless_begun and actions.request_taken(session, instance_uuid, request_id):
            return False
        if undo is not None:
            try:
                instances.update_cas(session, instance_uuid, undo, expected_task_state=(undo_from,))
            except errors.UnexpectedTaskState:
                logger.warning("state changed meanwhile; left as is", extra={"instance_uuid": instance_uuid})
        action = session.scalars(select(InstanceAction).where(
            InstanceAction.instance_uuid == instance_uuid, InstanceAction.request_id == request_id)).one_or_none()
        if action is not None:
            session.execute(delete(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id))
            session.delete(action)
    return True


def _start_or_undo(state_machine_arn: str, name: str, payload: dict[str, Any], cell: CellMapping,
                   undo: dict[str, Any] | None, undo_from: str) -> None:
    """Start a workflow; if that fails, undo the accepted state change (:func:`_undo`) and raise,
    unless the workflow began after all (its start answered an error, and Step Functions could
    not show the execution, yet its first step took the request): then the request stands."""
    try:
        workflows.start_execution(state_machine_arn, name, payload)
    except Exception:
        if not _undo(cell, payload["instance_uuid"], payload["request_id"], undo, undo_from, unless_begun=True):
            logger.warning("starting the workflow answered an error, but it began; the request stands",
                           extra={"instance_uuid": payload["instance_uuid"], "execution": name})
            return
        logger.exception("workflow did not start; the state change was undone",
                         extra={"instance_uuid": payload["instance_uuid"]})
        raise


def update_server(ctx: RequestContext, location: Location, changes: Mapping[str, str | None]) -> Server:
    """Rename a server, or change its description or hostname (``changes`` by the API's field
    names, see :data:`ferry.compute.instances.UPDATABLE`); the server as it is then.

    As in Nova, a locked, moving or failed server can be renamed too, with one exception: while
    a move between cells switches the server from one cell's copy to the other's (task state
    ``resize_finish``, or ``resize_reverting`` for a revert), a change could land on the copy
    being left, so it is refused (409) until the switch is over. A server still a build request
    has the request changed; the boot workflow gives the change to the server's cell when it
    hands the server over (``boot._hand_over``). A server that changed place meanwhile (handed
    over, or switched cells) is changed where it is then.

    Raises:
        InstanceNotFound: the server is gone.
        InstanceInvalidState: it is switching cells.
    """
    values = {instances.UPDATABLE[name]: value for name, value in changes.items()}
    uuid = location.instance_uuid
    if not values:
        return get_server(ctx, uuid)
    for _attempt in range(3):
        if location.cell is None:
            changed = _update_build_request(uuid, values)
        else:
            the_server = (Instance.uuid == uuid, Instance.deleted.is_(False), Instance.hidden.is_(False))
            with cell_session(location.cell) as session:
                stmt = (update(Instance).where(*the_server, ~_switching_cells(uuid))
                        .values(**values).execution_options(synchronize_session=False))
                changed = cast(CursorResult[Any], session.execute(stmt)).rowcount == 1
                if not changed:
                    switching = session.scalars(select(Instance.task_state).where(
                        *the_server, _switching_cells(uuid))).first()
                    if switching is not None:
                        raise errors.InstanceInvalidState(
                            f"Cannot 'update' instance {uuid} while it is in task_state {switching}: it is "
                            f"moving between cells. Try again when the move has settled.")
        if changed:
            logger.info("server updated", extra={"instance_uuid": uuid, "fields": sorted(changes)})
            return get_server(ctx, uuid)
        location = locate(ctx, uuid)
    raise errors.InstanceNotFound(f"Instance {uuid} could not be found.")


def _switching_cells(instance_uuid: str) -> ColumnElement[bool]:
    """Whether the instance row is one a move between cells is switching from or to: in
    ``resize_finish`` or ``resize_reverting``, with a cross-cell migration not yet settled."""
    unsettled = select(Migration.id).where(
        Migration.instance_uuid == instance_uuid, Migration.cross_cell_move.is_(True),
        Migration.status.not_in((migration_states.CONFIRMED, migration_states.REVERTED, migration_states.ERROR)))
    # A null task state is no switch: said outright, since NOT (NULL IN (...) AND ...) is NULL.
    return and_(Instance.task_state.is_not(None),
                Instance.task_state.in_((states.RESIZE_FINISH, states.RESIZE_REVERTING)), unsettled.exists())


def _update_build_request(instance_uuid: str, values: Mapping[str, str | None]) -> bool:
    """Change a build request's instance fields; False when it is gone (handed over to a cell).
    The row is locked while it is read and written, so that two changes never undo each other."""
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == instance_uuid)
                                .with_for_update()).one_or_none()
        if build is None:
            return False
        stmt = (update(BuildRequest).where(BuildRequest.instance_uuid == instance_uuid)
                .values(instance={**build.instance, **values}).execution_options(synchronize_session=False))
        return cast(CursorResult[Any], session.execute(stmt)).rowcount == 1


def delete_server(ctx: RequestContext, location: Location) -> None:
    """Delete a server.

    A server still in build requests is removed at once (its ports and reserved volume
    released, its mapping queued for delete). Otherwise the instance goes to task_state
    ``deleting`` (compare-and-swap) and the delete workflow runs; a server on a host whose
    service is down is deleted locally (records only), as Nova does. The workflow's
    ``delete_volumes`` names the volumes deleted with the server whose files its host removes.

    Raises:
        InstanceIsLocked: the server is locked and the caller is not an admin.
        InstanceInvalidState: another operation is in progress.
    """
    uuid = location.instance_uuid
    if location.cell is None:
        if _discard_build(uuid, forget=False):
            logger.info("unscheduled server deleted", extra={"instance_uuid": uuid})
            return
        location = locate(ctx, uuid)  # scheduled meanwhile: delete it from its cell
        if location.cell is None:
            return
    cell = location.cell
    payload: dict[str, Any] = {"instance_uuid": uuid, "request_id": ctx.request_id, "cell": cell.name}
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        _check_unlocked(ctx, instance)
        previous, host = instance.task_state, instance.host
        if host and not hosts.service_is_up(session, host):
            logger.warning("host is down; deleting locally", extra={"instance_uuid": uuid, "host": host})
        elif host:
            payload.update(host=host, queue_url=hosts.queue_url(host))
        # The files of volumes deleted with the server, for its host to remove; not while it is
        # still being built (its spawn may write a new volume's file after the host removed it).
        doomed = set() if instance.vm_state == states.BUILDING else instances.volumes_deleted_with(
            session, uuid, launched=instance.launched_at is not None)
        # A server in error may be deleted whatever its task, as long as it is still in error when
        # the swap lands (a reset meanwhile may have let a move take it).
        in_error = instance.vm_state == states.ERROR
        try:
            instances.update_cas(session, uuid, {"task_state": states.DELETING},
                                 expected_task_state=None if in_error else DELETABLE_TASK_STATES,
                                 expected_vm_state=(states.ERROR,) if in_error else None)
        except errors.UnexpectedTaskState as exc:
            current = instances.get(session, uuid)
            if in_error and current.vm_state != states.ERROR:
                raise _invalid_state("delete", uuid, "vm_state", current.vm_state) from exc
            raise _invalid_state("delete", uuid, "task_state", current.task_state) from exc
        actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id=ctx.request_id,
                             user_id=ctx.user_id, project_id=ctx.project_id)
    undo = None if previous == states.DELETING else {"task_state": previous}
    try:
        # Only the volumes the server holds, or that a delete of it before left ``deleting``: not
        # one detached from it, nor one another server holds.
        with api_session() as session:
            payload["delete_volumes"] = [{"volume_id": v.id, "path": v.path} for v in session.scalars(
                select(Volume).where(Volume.id.in_(doomed)).order_by(Volume.id))
                if (all(a.instance_uuid == uuid for a in v.attachments)
                    and (v.attachments or v.status == volume_store.DELETING))]
    except Exception:
        _undo(cell, uuid, ctx.request_id, undo, states.DELETING)
        raise
    _start_or_undo(config.get().delete_state_machine_arn, execution_name("delete", uuid, ctx.request_id), payload,
                   cell, undo=undo, undo_from=states.DELETING)


def _power(ctx: RequestContext, location: Location, action: str, operation: str, from_vm_state: str,
           task_state: str) -> None:
    uuid = location.instance_uuid
    if location.cell is None:
        raise _invalid_state(action, uuid, "vm_state", states.BUILDING)
    cell = location.cell
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        _check_unlocked(ctx, instance)
        host = instance.host
        if host is None:  # Nova's check_instance_host
            raise errors.InstanceNotReady(f"Instance {uuid} is not ready")
        try:
            instances.update_cas(session, uuid, {"task_state": task_state}, expected_task_state=(None,),
                                 expected_vm_state=(from_vm_state,))
        except errors.UnexpectedTaskState as exc:
            current = instances.get(session, uuid)
            if current.vm_state != from_vm_state:
                raise _invalid_state(action, uuid, "vm_state", current.vm_state) from exc
            raise _invalid_state(action, uuid, "task_state", current.task_state) from exc
        # Looked up inside the transaction: if the host has no queue, nothing is changed.
        queue_url = hosts.queue_url(host)
        actions.start_action(session, instance_uuid=uuid, action=action, request_id=ctx.request_id,
                             user_id=ctx.user_id, project_id=ctx.project_id)
    payload = {"instance_uuid": uuid, "request_id": ctx.request_id, "cell": cell.name, "host": host,
               "queue_url": queue_url, "operation": operation}
    _start_or_undo(config.get().power_state_machine_arn, execution_name("power", uuid, ctx.request_id), payload,
                   cell, undo={"task_state": None}, undo_from=task_state)


def stop_server(ctx: RequestContext, location: Location) -> None:
    """os-stop: an active server with no task goes to ``powering-off`` and the power workflow runs.

    Raises:
        InstanceIsLocked: locked, and the caller is not an admin.
        InstanceNotReady: the server has no host.
        InstanceInvalidState: not active, or another operation is in progress.
    """
    _power(ctx, location, actions.STOP, protocol.POWER_OFF, states.ACTIVE, states.POWERING_OFF)


def start_server(ctx: RequestContext, location: Location) -> None:
    """os-start: a stopped server with no task goes to ``powering-on`` and the power workflow runs.

    Raises:
        InstanceIsLocked: locked, and the caller is not an admin.
        InstanceNotReady: the server has no host.
        InstanceInvalidState: not stopped, or another operation is in progress.
    """
    _power(ctx, location, actions.START, protocol.POWER_ON, states.STOPPED, states.POWERING_ON)


# --- instance actions ------------------------------------------------------------------------------


def _action_dict(action: InstanceAction) -> dict[str, Any]:
    return {"action": action.action, "instance_uuid": action.instance_uuid, "request_id": action.request_id,
            "user_id": action.user_id, "project_id": action.project_id, "start_time": action.start_time,
            "finish_time": action.finish_time, "message": action.message, "updated_at": action.updated_at}


def list_instance_actions(location: Location, *, limit: int | None = None, marker: str | None = None,
                          changes_since: dt.datetime | None = None,
                          changes_before: dt.datetime | None = None) -> list[dict[str, Any]]:
    """The actions recorded for a server, newest first (none while it is a build request).

    The actions of a deleted server are read as well: its cell keeps them. ``changes_since``
    and ``changes_before`` compare the action's last change (an event started or finished;
    its start when none did), both ends included; ``marker`` is the request id of the last
    action of the page before (found whether or not it passes the time filters); ``limit``
    None lists every action.

    Raises:
        BadRequest: the marker is not one of the server's actions.
    """
    if location.cell is None:
        return []
    with cell_session(location.cell) as session:
        rows = list(session.scalars(select(InstanceAction).where(
            InstanceAction.instance_uuid == location.instance_uuid)
            .order_by(InstanceAction.start_time.desc(), InstanceAction.id.desc())))
        rows = after_marker(rows, marker, lambda row: row.request_id, f"Marker {marker} could not be found.")

        def wanted(row: InstanceAction) -> bool:
            changed = row.updated_at or row.start_time
            return ((changes_since is None or changed >= changes_since)
                    and (changes_before is None or changed <= changes_before))

        return [_action_dict(row) for row in itertools.islice(filter(wanted, rows), limit)]


def get_instance_action(location: Location, request_id: str) -> dict[str, Any]:
    """One action of a server with its ``events`` (newest first, as Nova lists them).

    Raises:
        NotFound: the server has no action with that request id.
    """
    missing = errors.NotFound(f"Action for request_id {request_id} on instance {location.instance_uuid} not found")
    if location.cell is None:
        raise missing
    with cell_session(location.cell) as session:
        action = session.scalars(select(InstanceAction).where(
            InstanceAction.instance_uuid == location.instance_uuid, InstanceAction.request_id == request_id)
        ).one_or_none()
        if action is None:
            raise missing
        events = session.scalars(select(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id)
                                 .order_by(InstanceActionEvent.start_time.desc(), InstanceActionEvent.id.desc()))
        result = _action_dict(action)
        result["events"] = [{"event": e.event, "start_time": e.start_time, "finish_time": e.finish_time,
                             "result": e.result, "traceback": e.traceback, "host": e.host, "details": e.details}
                            for e in events]
        return result


# --- flavors ---------------------------------------------------------------------------------------


def _flavor(session: Session, flavorid: str) -> Flavor:
    flavor = session.scalars(select(Flavor).where(Flavor.flavorid == flavorid)).one_or_none()
    if flavor is None:
        raise errors.FlavorNotFound(f"Flavor {flavorid} could not be found.")
    return flavor


def get_flavor(flavorid: str, ctx: RequestContext | None = None) -> Flavor:
    """The flavor with the public id ``flavorid`` (a name is not an id); with ``ctx``, only one
    the caller may use (see :mod:`ferry.compute.flavor_access`).

    Raises:
        FlavorNotFound: no such flavor (or a private one the caller has no access to).
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        if ctx is not None and not flavor_access.usable(ctx, flavor):
            raise errors.FlavorNotFound(f"Flavor {flavorid} could not be found.")
        return flavor


# Flavor list sort keys (Nova's) and the columns they order by. Ferry's flavors have no
# ``vcpu_weight`` (null on every Nova flavor unless set): ordered by it, they keep the tiebreak's
# order, the internal id's (creation order), as in Nova.
FLAVOR_SORT_KEYS: dict[str, Any] = {
    "flavorid": Flavor.flavorid, "id": Flavor.id, "name": Flavor.name, "memory_mb": Flavor.memory_mb,
    "vcpus": Flavor.vcpus, "root_gb": Flavor.root_gb, "ephemeral_gb": Flavor.ephemeral_gb, "swap": Flavor.swap,
    "rxtx_factor": Flavor.rxtx_factor, "is_public": Flavor.is_public, "disabled": Flavor.disabled,
    "description": Flavor.description, "created_at": Flavor.created_at, "updated_at": Flavor.updated_at,
    "vcpu_weight": None,
}


def list_flavors(ctx: RequestContext, *, is_public: bool | None = True, min_disk: int | None = None,
                 min_ram: int | None = None, limit: int | None = None, marker: str | None = None,
                 sort_key: str = "flavorid", sort_dir: str = "asc") -> list[Flavor]:
    """Flavors ordered by ``sort_key`` (one of :data:`FLAVOR_SORT_KEYS`; the internal id breaks
    ties, in the same direction) in ``sort_dir``, by flavor id ascending by default, as Nova lists them.

    Non-admins see the enabled flavors they may use (public ones and private ones their project
    has access to) whatever they ask; admins choose with ``is_public`` (``None`` means public
    and private).

    Raises:
        BadRequest: an unknown sort key or direction, or the marker is not a flavor in the list.
    """
    if sort_key not in FLAVOR_SORT_KEYS or sort_dir not in ("asc", "desc"):
        raise errors.BadRequest(f"Invalid sort key {sort_key!r} or direction {sort_dir!r} for flavors.")
    column = FLAVOR_SORT_KEYS[sort_key]
    tiebreak = Flavor.id.desc() if sort_dir == "desc" else Flavor.id.asc()
    if column is None:
        query = select(Flavor).order_by(tiebreak)
    else:
        query = select(Flavor).order_by(column.desc() if sort_dir == "desc" else column.asc(), tiebreak)
    if not ctx.is_admin:
        query = query.where(flavor_access.usable_clause(ctx), Flavor.disabled.is_(False))
    elif is_public:  # as Nova: the public flavors and those the admin's own project has access to
        query = query.where(flavor_access.usable_clause(ctx))
    elif is_public is not None:
        query = query.where(Flavor.is_public.is_(False))
    if min_disk is not None:
        query = query.where(Flavor.root_gb >= min_disk)
    if min_ram is not None:
        query = query.where(Flavor.memory_mb >= min_ram)
    with api_session() as session:
        flavors = list(session.scalars(query))
    flavors = after_marker(flavors, marker or None, lambda f: f.flavorid, f"marker [{marker}] not found")
    return flavors[:page_size(limit)]


def create_flavor(*, name: str, vcpus: int, memory_mb: int, root_gb: int, ephemeral_gb: int = 0, swap: int = 0,
                  flavorid: str | None = None, rxtx_factor: float = 1.0, is_public: bool = True,
                  description: str | None = None) -> Flavor:
    """Create a flavor; without ``flavorid`` it gets a uuid.

    Raises:
        BadRequest: vcpus or memory below 1, or a negative size.
        FlavorExists: the name or the id is taken.
    """
    if vcpus < 1 or memory_mb < 1:
        raise errors.BadRequest("Flavor vcpus and ram must be at least 1.")
    if min(root_gb, ephemeral_gb, swap) < 0 or rxtx_factor <= 0:
        raise errors.BadRequest("Flavor disk, ephemeral and swap cannot be negative; rxtx_factor must be positive.")
    flavorid = flavorid or str(uuidlib.uuid4())
    with api_session() as session:
        if session.scalars(select(Flavor.id).where(Flavor.name == name)).first() is not None:
            raise errors.FlavorExists(f"Flavor with name {name} already exists.")
        if session.scalars(select(Flavor.id).where(Flavor.flavorid == flavorid)).first() is not None:
            raise errors.FlavorExists(f"Flavor with ID {flavorid} already exists.")
        flavor = Flavor(flavorid=flavorid, name=name, vcpus=vcpus, memory_mb=memory_mb, root_gb=root_gb,
                        ephemeral_gb=ephemeral_gb, swap=swap, rxtx_factor=rxtx_factor, is_public=is_public,
                        disabled=False, description=description)
        try:
            with session.begin_nested():
                session.add(flavor)
        except IntegrityError as exc:
            raise errors.FlavorExists(f"Flavor {name} ({flavorid}) already exists.") from exc
        session.refresh(flavor)
    logger.info("flavor created", extra={"flavorid": flavorid, "flavor_name": name})
    return flavor


def update_flavor_description(flavorid: str, description: str | None) -> Flavor:
    """Change a flavor's description (the only field Nova lets change).

    Raises:
        FlavorNotFound: no such flavor.
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        flavor.description = description
        session.flush()
        session.refresh(flavor)
        return flavor


def delete_flavor(flavorid: str) -> None:
    """Delete a flavor; servers keep their copy of it.

    Raises:
        FlavorNotFound: no such flavor.
    """
    with api_session() as session:
        session.delete(_flavor(session, flavorid))
    logger.info("flavor deleted", extra={"flavorid": flavorid})


def flavor_projects(flavorid: str) -> list[str]:
    """The projects with access to a private flavor, in the order they were given it.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessNotFound: the flavor is public (it has no access list).
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        if flavor.is_public:
            raise errors.FlavorAccessNotFound("Access list not available for public flavors.")
        return _project_ids(flavor)


def _project_ids(flavor: Flavor) -> list[str]:
    """The projects with access to ``flavor``, in the order they were given it."""
    return [p.project_id for p in sorted(flavor.projects, key=lambda p: p.id)]


def add_flavor_access(flavorid: str, project_id: str, *, refuse_public: bool = True) -> list[str]:
    """Give a project access to a flavor; the projects with access afterwards.

    Params:
        refuse_public: refuse a public flavor (Nova from 2.7); without it, the access to a public
            flavor is recorded (it changes nothing: the flavor is anyone's), as Nova does below 2.7.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessExists: the flavor is public (with ``refuse_public``), or the project has access already.
    """
    exists = errors.FlavorAccessExists(
        f"Flavor access already exists for flavor {flavorid} and project {project_id} combination.")
    try:
        with api_session() as session:
            flavor = _flavor(session, flavorid)
            if flavor.is_public and refuse_public:
                raise errors.FlavorAccessExists("Can not add access to a public flavor.")
            if any(p.project_id == project_id for p in flavor.projects):
                raise exists
            flavor.projects.append(FlavorProject(project_id=project_id))
            session.flush()
            projects = _project_ids(flavor)
    except IntegrityError as exc:  # the same access given, or the flavor deleted, by a concurrent request
        with api_session() as session:
            _flavor(session, flavorid)
        raise exists from exc
    logger.info("flavor access added", extra={"flavorid": flavorid, "project_id": project_id})
    return projects


def remove_flavor_access(flavorid: str, project_id: str) -> list[str]:
    """Take a project's access to a flavor away (a public flavor's too, recorded below 2.7); the
    projects with access afterwards.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessNotFound: the project has no access to it.
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        granted = next((p for p in flavor.projects if p.project_id == project_id), None)
        if granted is None:
            raise errors.FlavorAccessNotFound(
                f"Flavor access not found for {flavorid} / {project_id} combination.")
        flavor.projects.remove(granted)
        projects = _project_ids(flavor)
    logger.info("flavor access removed", extra={"flavorid": flavorid, "project_id": project_id})
    return projects


def get_extra_specs(flavorid: str, ctx: RequestContext | None = None) -> dict[str, str]:
    """A flavor's extra specs (with ``ctx``, of a flavor the caller may use).

    Raises:
        FlavorNotFound: no such flavor (or a private one the caller has no access to).
    """
    return dict(get_flavor(flavorid, ctx).specs)


# The longest extra spec value a flavor keeps (the column's size, and Nova's bound).
MAX_EXTRA_SPEC_VALUE = 255


def set_extra_specs(flavorid: str, specs: Mapping[str, Any]) -> dict[str, str]:
    """Add or replace extra specs (others are kept); returns the flavor's specs afterwards.

    Values are stored as strings: a number as it reads (``3``, ``1.5``).

    Raises:
        BadRequest: a value (a number written out included) longer than 255 characters; nothing is stored.
        FlavorNotFound: no such flavor.
    """
    values = {key: str(value) for key, value in specs.items()}
    if any(len(value) > MAX_EXTRA_SPEC_VALUE for value in values.values()):
        raise errors.BadRequest(
            f"Invalid input received: extra_specs value has more than {MAX_EXTRA_SPEC_VALUE} characters.")
    try:
        return _write_extra_specs(flavorid, values)
    except IntegrityError:
        # A concurrent request added one of these keys between the read and the insert (the unique
        # flavor and key), or deleted the flavor: run again, which updates its row (or finds no flavor).
        return _write_extra_specs(flavorid, values)


def _write_extra_specs(flavorid: str, values: Mapping[str, str]) -> dict[str, str]:
    """Update the flavor's rows of these keys, and add the missing ones, in one transaction; the
    flavor's specs afterwards.

    Raises:
        FlavorNotFound: no such flavor.
        IntegrityError: a row added meanwhile by another transaction (nothing is written).
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        existing = {spec.key: spec for spec in flavor.extra_specs}
        for key, value in values.items():
            if key in existing:
                existing[key].value = value
            else:
                flavor.extra_specs.append(FlavorExtraSpec(key=key, value=value))
        session.flush()
        return {spec.key: spec.value for spec in flavor.extra_specs}


def delete_extra_spec(flavorid: str, key: str) -> None:
    """Remove one extra spec.

    Raises:
        FlavorNotFound: no such flavor.
        NotFound: the flavor has no such key.
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        spec = next((s for s in flavor.extra_specs if s.key == key), None)
        if spec is None:
            raise errors.NotFound(f"Flavor {flavorid} has no extra specs with key {key}.")
        flavor.extra_specs.remove(spec)
